//! Request ids through the real gRPC service of one metadata server: a change sent again with
//! its id is answered as the first time and not made again, also after a restart (snapshot and
//! log replay); one with another id is a new call.

use tern_common::config::Serve;
use tern_proto::identity::{ClusterSecret, Identity, Presents, Role};
use tern_proto::request_id::{RequestId, RequestIds, REQUEST_ID_HEADER};
use tern_proto::v1::metadata_client::MetadataClient;
use tern_proto::v1::registry_client::RegistryClient;
use tern_proto::v1::*;
use tern_proto::ErrorKind;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

use crate::config::Config;
use crate::server::start;

type Client = MetadataClient<InterceptedService<Channel, Presents>>;

fn with_id<T>(message: T, id: RequestId) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.metadata_mut().insert(REQUEST_ID_HEADER, id.to_string().parse().unwrap());
    request
}

fn channel(config: &Config) -> Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{}", config.serve.listen)).unwrap().connect_lazy()
}

fn client(config: &Config, presents: Presents) -> Client {
    MetadataClient::with_interceptor(channel(config), presents)
}

fn config(dir: &std::path::Path) -> Config {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let secret = dir.join("cluster.secret");
    ClusterSecret::generate().write_new(&secret).unwrap();
    Config {
        serve: Serve::on_loopback(port, 0),
        dir: dir.join("m"),
        cluster_secret_file: Some(secret),
        ..Config::default()
    }
}

async fn jobs(client: &mut Client) -> usize {
    client.status(StatusRequest {}).await.unwrap().into_inner().jobs.len()
}

async fn outputs(client: &mut Client, shuffle_id: u64) -> usize {
    let ask = LocateShuffleRequest { shuffle_id, end_partition: 1, end_map: 4, ..Default::default() };
    client.locate_shuffle(ask).await.unwrap().into_inner().outputs.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_sent_again_with_its_id_is_answered_not_made_again() {
    let temp = tempfile::tempdir().unwrap();
    let config = config(temp.path());
    let secret = ClusterSecret::load(config.cluster_secret_file.as_ref().unwrap()).unwrap();
    let server = start(config.clone()).await.unwrap();
    let ids = RequestIds::new();
    let mut anyone = client(&config, Presents::default());

    // A storage server, so a shuffle can be placed.
    let address = "127.0.0.1:9".to_string();
    let credential = secret.credential(&Identity::new(Role::Server, "", &address));
    let mut registry = RegistryClient::with_interceptor(channel(&config), Presents::credential(&credential).unwrap());
    let tiers = vec![TierUsage { tier: "dram".into(), capacity_blocks: 64, ..TierUsage::default() }];
    let ask = RegisterServerRequest { address, tiers, instance_id: 1, ..Default::default() };
    let server_id = registry.register_server(ask).await.unwrap().into_inner().server_id;
    let inventory = ReportInventoryRequest { server_id, last: true, ..Default::default() };
    registry.report_inventory(inventory).await.unwrap();

    // RegisterJob with a generated name: done twice, it would make two jobs.
    let register = ids.next();
    let job = anyone.register_job(with_id(RegisterJobRequest::default(), register)).await.unwrap().into_inner();
    let again = anyone.register_job(with_id(RegisterJobRequest::default(), register)).await.unwrap().into_inner();
    assert_eq!(again, job, "the retry gets the first answer, token included");
    assert_eq!(jobs(&mut anyone).await, 1, "and no second job");
    let mut owner = client(&config, Presents::job_token(&job.token).unwrap());

    // Create: the retry gets the file id; another id is a new call, refused as before.
    let create = ids.next();
    let path = format!("{}/f", job.root);
    let ask = || CreateRequest { path: path.clone(), ..Default::default() };
    let created = owner.create(with_id(ask(), create)).await.unwrap().into_inner();
    assert_eq!(owner.create(with_id(ask(), create)).await.unwrap().into_inner(), created);
    let refused = owner.create(with_id(ask(), ids.next())).await.unwrap_err();
    assert_eq!(ErrorKind::of_status(&refused), ErrorKind::AlreadyExists, "{refused:?}");
    let refused = owner.create(ask()).await.unwrap_err();
    assert_eq!(ErrorKind::of_status(&refused), ErrorKind::AlreadyExists, "without an id, as before: {refused:?}");
    // The id is the call's: used for another call, it is refused.
    let mkdir = MkdirRequest { path: format!("{}/d", job.root), ..Default::default() };
    let refused = owner.mkdir(with_id(mkdir, create)).await.unwrap_err();
    assert_eq!(ErrorKind::of_status(&refused), ErrorKind::Invalid, "{refused:?}");

    // CommitMap: a retry after the map was invalidated is answered, not committed again.
    let ask = RegisterShuffleRequest { job_id: job.job_id.clone(), partitions: 1, maps: 4, ..Default::default() };
    let shuffle = owner.register_shuffle(with_id(ask, ids.next())).await.unwrap().into_inner().shuffle_id;
    let commit = ids.next();
    let map = || CommitMapRequest {
        shuffle_id: shuffle,
        map_index: 0,
        attempt: 1,
        partition_bytes: vec![5],
        ..Default::default()
    };
    let committed = owner.commit_map(with_id(map(), commit)).await.unwrap().into_inner();
    assert!(committed.committed);
    assert_eq!(outputs(&mut owner, shuffle).await, 1);
    let invalidate = InvalidateMapsRequest { shuffle_id: shuffle, map_indexes: vec![0] };
    owner.invalidate_maps(with_id(invalidate, ids.next())).await.unwrap();
    assert_eq!(outputs(&mut owner, shuffle).await, 0);
    assert_eq!(owner.commit_map(with_id(map(), commit)).await.unwrap().into_inner(), committed);
    assert_eq!(outputs(&mut owner, shuffle).await, 0, "the retried commit was not made again");

    // After restarts (the log replayed and a snapshot written; then that snapshot read): still
    // answered.
    let mut server = server;
    for _ in 0..2 {
        server.shutdown().await;
        server = start(config.clone()).await.unwrap();
    }
    let mut anyone = client(&config, Presents::default());
    let mut owner = client(&config, Presents::job_token(&job.token).unwrap());
    let again = anyone.register_job(with_id(RegisterJobRequest::default(), register)).await.unwrap().into_inner();
    assert_eq!((again.job_id, again.token), (job.job_id.clone(), job.token.clone()));
    assert_eq!(jobs(&mut anyone).await, 1);
    assert_eq!(
        owner
            .create(with_id(CreateRequest { path: path.clone(), ..Default::default() }, create))
            .await
            .unwrap()
            .into_inner(),
        created
    );
    assert_eq!(owner.commit_map(with_id(map(), commit)).await.unwrap().into_inner(), committed);
    assert_eq!(outputs(&mut owner, shuffle).await, 0);
    // A new id is a new call: another job, a commit made.
    anyone.register_job(with_id(RegisterJobRequest::default(), ids.next())).await.unwrap();
    assert_eq!(jobs(&mut anyone).await, 2);
    owner.commit_map(with_id(map(), ids.next())).await.unwrap();
    assert_eq!(outputs(&mut owner, shuffle).await, 1);
    server.shutdown().await;
}
