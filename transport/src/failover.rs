//! Finding the leader of a replicated metadata service: the gRPC channel of every caller of the
//! metadata service (clients, storage servers, the scheduler, executors, the Spark plugin) over
//! its addresses (`--metadata a,b,c`, [`metadata_addresses`]). A call answered `not the leader; the leader is ADDR`
//! is sent again to ADDR; a call that cannot reach its server goes to the next address. Each
//! call makes at most [`MAX_ATTEMPTS_PER_ADDRESS`] tries per address, [`RETRY_PAUSE`] apart
//! after a failure to connect or a not-leader answer naming no leader (an election, or a server
//! removed from the membership or not yet added, which never learns of one), each of which moves
//! to the next address; the last answer (or error) is the call's. With one address the channel passes calls straight through, as before.
//!
//! A call's own deadline (its `grpc-timeout`, as `tonic::Request::set_timeout` writes it) bounds
//! each try, not only the whole call, connecting included (tonic enforces it only once the
//! request is on a connection), so a leader whose packets vanish holds a try that long before the
//! next address is asked. Calls that must reach a new leader quickly (lease renewals, heartbeats)
//! set one. A call without one is bounded by the connections' pings (`KEEP_ALIVE_*`). A replica
//! named as the leader just after it said it does not lead (a leader cut off from its majority,
//! before the others elect) is not asked again at once: the next address is, after the pause.
//!
//! Every call that changes metadata ([`tern_proto::request_id::is_mutating`]) gets a request id
//! here, once, in its [`REQUEST_ID_HEADER`]: its tries resend the same bytes and headers, so the
//! server, which remembers each completed call's answer by its id in its replicated state,
//! answers a retry of a change it made (its answer lost to a failover or a dropped connection)
//! with that answer instead of making it twice.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http_body_util::BodyExt;
use tern_proto::request_id::{is_mutating, RequestIds, REQUEST_ID_HEADER};
use tonic::body::Body;
use tonic::transport::Channel;
use tower::{Service, ServiceExt};

/// Most metadata addresses one caller is given (a replicated service has 3 or 5 members; 7 leaves
/// room for one being replaced).
pub const MAX_METADATA_ADDRESSES: usize = 7;

/// The addresses in a metadata address list (`a,b,c`, spaces allowed, each `host:port` with or
/// without an `http://` or `https://` scheme), as given (the scheme decides TLS), or why the list
/// is not one.
pub fn metadata_addresses(list: &str) -> Result<Vec<&str>, String> {
    let given: Vec<&str> = list.split(',').map(str::trim).filter(|a| !a.is_empty()).collect();
    if given.is_empty() || given.len() > MAX_METADATA_ADDRESSES {
        return Err(format!(
            "the metadata address {list:?} names {} servers; give 1 to {MAX_METADATA_ADDRESSES}",
            given.len()
        ));
    }
    Ok(given)
}

/// An address of the list without its scheme: `host:port`, as replicas name each other (and
/// the leader) in their answers.
pub fn bare_address(address: &str) -> &str {
    address.trim_start_matches("http://").trim_start_matches("https://").trim_end_matches('/')
}

/// How often a failover channel pings each replica it is connected to (HTTP/2 PING), busy or idle.
pub const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(1);
/// How long a ping may go unanswered before the connection is taken for dead: every call in
/// flight on it fails and goes to the next address.
pub const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(2);

/// A failover channel over lazy channels to each of `addresses` (as [`metadata_addresses`] gives
/// them; TLS by each one's scheme, else when `tls` is given), each endpoint `tune`d. Lazy: a
/// replica that is down must not keep the caller from the others.
///
/// Each connection is pinged ([`KEEP_ALIVE_INTERVAL`], [`KEEP_ALIVE_TIMEOUT`]): a call with no
/// deadline of its own sent to a leader whose packets vanish was otherwise held for the
/// endpoint's whole request timeout (30 s for a client) before the next address was asked, though
/// the caller's lease renewals had long found the new leader (multihost::replicated, about one
/// run in two). A ping unanswered for 2 s ends the connection and fails the calls on it, so such a
/// call is on the next address within about 3 s, and a slow answer to a live leader (which keeps
/// answering pings) is still waited for.
pub fn lazy_failover(
    addresses: &[&str],
    tls: Option<&crate::tls::TlsMaterial>,
    tune: impl Fn(tonic::transport::Endpoint) -> tonic::transport::Endpoint,
) -> anyhow::Result<Failover> {
    let mut channels = Vec::with_capacity(addresses.len());
    for one in addresses {
        let endpoint = crate::tls::grpc_endpoint(one, tls)?
            .http2_keep_alive_interval(KEEP_ALIVE_INTERVAL)
            .keep_alive_timeout(KEEP_ALIVE_TIMEOUT)
            .keep_alive_while_idle(true);
        channels.push(tune(endpoint).connect_lazy());
    }
    Ok(Failover::new(addresses.iter().map(|a| bare_address(a).to_string()).collect(), channels))
}

/// Tries per address for one call.
pub const MAX_ATTEMPTS_PER_ADDRESS: usize = 5;
/// Pause before trying again after a connection failure or a "no leader yet" answer.
pub const RETRY_PAUSE: Duration = Duration::from_millis(200);
/// The metadata server's words for "ask another": see `metadata-server/src/raft/mod.rs`.
const NOT_LEADER: &str = "not the leader";
const LEADER_IS: &str = "the leader is ";

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A channel to each metadata address, and the one believed to lead.
#[derive(Clone)]
pub struct Failover {
    addrs: Arc<Vec<String>>,
    channels: Arc<Vec<Channel>>,
    current: Arc<AtomicUsize>,
    /// This client's request ids (one random client id for all its calls).
    ids: Arc<RequestIds>,
}

impl Failover {
    /// `channels[i]` reaches `addrs[i]` (host:port, as the servers name each other in `peers`).
    pub fn new(addrs: Vec<String>, channels: Vec<Channel>) -> Failover {
        assert!(!channels.is_empty() && addrs.len() == channels.len(), "one channel per address");
        Failover {
            addrs: Arc::new(addrs),
            channels: Arc::new(channels),
            current: Arc::new(AtomicUsize::new(0)),
            ids: Arc::new(RequestIds::new()),
        }
    }
}

/// Where a refusal says the leader is: `Some(Some(addr))`, `Some(None)` when it is a not-leader
/// answer naming none (an election), `None` for every other answer.
fn not_leader(response: &http::Response<Body>) -> Option<Option<String>> {
    let status = tonic::Status::from_header_map(response.headers())?;
    if status.code() != tonic::Code::Unavailable || !status.message().contains(NOT_LEADER) {
        return None;
    }
    let message = status.message();
    Some(message.find(LEADER_IS).map(|at| {
        let rest = &message[at + LEADER_IS.len()..];
        rest.split(|c: char| c.is_whitespace() || c == ',' || c == ';').next().unwrap_or_default().to_string()
    }))
}

/// A `grpc-timeout` header's duration (an integer of at most 8 digits and a unit: H, M, S, m, u
/// or n), or None for a malformed one.
fn grpc_timeout(value: &http::HeaderValue) -> Option<Duration> {
    let value = value.to_str().ok()?;
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// Gives a call that changes metadata its request id, unless it has one already.
fn with_request_id<B>(request: &mut http::Request<B>, ids: &RequestIds) {
    if is_mutating(request.uri().path()) && !request.headers().contains_key(REQUEST_ID_HEADER) {
        let id = http::HeaderValue::from_str(&ids.next().to_string()).expect("hex digits are a header value");
        request.headers_mut().insert(REQUEST_ID_HEADER, id);
    }
}

impl Service<http::Request<Body>> for Failover {
    type Response = http::Response<Body>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        // Each call waits for its own channel's readiness.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut request: http::Request<Body>) -> Self::Future {
        let this = self.clone();
        // Here, before the first try, so that every try carries the same id.
        with_request_id(&mut request, &this.ids);
        Box::pin(async move {
            if this.channels.len() == 1 {
                let mut channel = this.channels[0].clone();
                return Ok(channel.ready().await?.call(request).await?);
            }
            let (parts, body) = request.into_parts();
            // Tonic enforces a call's deadline on a request once it is on a connection, not while
            // the channel connects: bounded here, a try of a replica whose connection the pings
            // ended waits its deadline, not the connect timeout.
            let per_try = parts.headers.get("grpc-timeout").and_then(grpc_timeout);
            let bytes = body.collect().await?.to_bytes();
            let n = this.channels.len();
            let mut last: Option<Result<http::Response<Body>, BoxError>> = None;
            // The address that last said it is not the leader and named none: a leader cut off
            // from its majority says so, while the others may still name it until they elect.
            let mut unled: Option<usize> = None;
            for _ in 0..n * MAX_ATTEMPTS_PER_ADDRESS {
                let at = this.current.load(Ordering::Relaxed) % n;
                let mut again = http::Request::builder().method(parts.method.clone()).uri(parts.uri.clone());
                for (name, value) in &parts.headers {
                    again = again.header(name, value);
                }
                let again = again
                    .version(parts.version)
                    .body(Body::new(http_body_util::Full::new(bytes.clone())))
                    .expect("rebuilt from a valid request");
                let mut channel = this.channels[at].clone();
                let next = |current: &AtomicUsize| {
                    let _ = current.compare_exchange(at, (at + 1) % n, Ordering::Relaxed, Ordering::Relaxed);
                };
                let attempt = async { channel.ready().await?.call(again).await };
                let answer: Result<http::Response<Body>, BoxError> = match per_try {
                    Some(deadline) => match tokio::time::timeout(deadline, attempt).await {
                        Ok(answer) => answer.map_err(Into::into),
                        Err(_) => {
                            Err(format!("no answer from {} within the call's {deadline:?}", this.addrs[at]).into())
                        }
                    },
                    None => attempt.await.map_err(Into::into),
                };
                match answer {
                    Err(e) => {
                        last = Some(Err(e));
                        next(&this.current);
                        tokio::time::sleep(RETRY_PAUSE).await;
                    }
                    Ok(response) => match not_leader(&response) {
                        None => return Ok(response),
                        Some(Some(leader)) => {
                            match this.addrs.iter().position(|a| *a == leader) {
                                // The one that just said it does not lead: the others have
                                // not elected yet; ask the next in a moment.
                                Some(i) if unled == Some(i) => {
                                    next(&this.current);
                                    tokio::time::sleep(RETRY_PAUSE).await;
                                }
                                Some(i) => this.current.store(i, Ordering::Relaxed),
                                None => next(&this.current),
                            }
                            last = Some(Ok(response));
                        }
                        Some(None) => {
                            // An election, a leader cut off from its majority, or a server no
                            // longer (or not yet) a member, which will never learn of a
                            // leader: the next one may know.
                            unled = Some(at);
                            last = Some(Ok(response));
                            next(&this.current);
                            tokio::time::sleep(RETRY_PAUSE).await;
                        }
                    },
                }
            }
            last.expect("at least one attempt")
        })
    }
}

#[cfg(test)]
mod tests {
    use tern_proto::request_id::RequestId;

    use super::*;

    fn answer(status: tonic::Status) -> http::Response<Body> {
        status.into_http()
    }

    #[test]
    fn address_lists_name_one_to_seven_servers() {
        assert_eq!(metadata_addresses(" a:1, http://b:2 ,").unwrap(), vec!["a:1", "http://b:2"]);
        assert_eq!(bare_address("https://b:2/"), "b:2");
        for bad in ["", " , ", "a,b,c,d,e,f,g,h"] {
            let why = metadata_addresses(bad).unwrap_err();
            assert!(why.contains("give 1 to 7"), "{bad:?}: {why}");
        }
    }

    /// Changes get an id, one per call, kept if the call has one; reads get none.
    #[test]
    fn changes_get_a_request_id_once() {
        let ids = RequestIds::new();
        let request = |path: &str| http::Request::builder().uri(path).body(()).unwrap();
        let id_of = |request: &http::Request<()>| {
            request.headers().get(REQUEST_ID_HEADER).map(|v| v.to_str().unwrap().parse::<RequestId>().unwrap())
        };
        let mut create = request("http://m/tern.v1.Metadata/Create");
        with_request_id(&mut create, &ids);
        let first = id_of(&create).expect("a change carries an id");
        with_request_id(&mut create, &ids);
        assert_eq!(id_of(&create), Some(first), "given once: a resend keeps it");
        let mut commit = request("http://m/tern.v1.Metadata/CommitMap");
        with_request_id(&mut commit, &ids);
        let second = id_of(&commit).unwrap();
        assert_ne!(second, first);
        assert_eq!(second.client(), first.client());
        let mut stat = request("http://m/tern.v1.Metadata/Stat");
        with_request_id(&mut stat, &ids);
        assert_eq!(id_of(&stat), None, "reads carry none");
    }

    /// Answers every call with NOT_FOUND naming itself: an address that is reachable and not a
    /// follower.
    #[derive(Clone)]
    struct Answers;

    impl tonic::server::NamedService for Answers {
        const NAME: &'static str = "test.Answers";
    }

    impl Service<http::Request<Body>> for Answers {
        type Response = http::Response<Body>;
        type Error = std::convert::Infallible;
        type Future = std::future::Ready<Result<http::Response<Body>, std::convert::Infallible>>;

        fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _request: http::Request<Body>) -> Self::Future {
            std::future::ready(Ok(answer(tonic::Status::not_found("answered by the second address"))))
        }
    }

    /// A failover channel over a silent address (it accepts connections and never answers: a
    /// leader whose packets vanish after the connection was made) and then an answering one,
    /// with no endpoint timeout.
    async fn silent_then_answering() -> Failover {
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let silent_address = silent.local_addr().unwrap();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = silent.accept().await {
                held.push(socket);
            }
        });
        let answering = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let answering_address = answering.local_addr().unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(Answers)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(answering)),
        );
        let addresses = [format!("{silent_address}"), format!("{answering_address}")];
        let addresses: Vec<&str> = addresses.iter().map(String::as_str).collect();
        lazy_failover(&addresses, None, |endpoint| endpoint).unwrap()
    }

    /// Calls `failover` (its grpc-timeout `deadline`, if any) and expects the answering address to
    /// answer within `within`.
    async fn answered_by_the_second_within(failover: &mut Failover, deadline: Option<&str>, within: Duration) {
        let mut call = http::Request::builder()
            .method("POST")
            .uri("http://metadata/test.Answers/Call")
            .header("content-type", "application/grpc");
        if let Some(deadline) = deadline {
            call = call.header("grpc-timeout", deadline);
        }
        let started = std::time::Instant::now();
        let call = failover.ready().await.unwrap().call(call.body(Body::empty()).unwrap());
        let response = tokio::time::timeout(Duration::from_secs(10), call)
            .await
            .expect("the call ended: the silent address held it 10 s")
            .unwrap();
        let status = tonic::Status::from_header_map(response.headers()).expect("a gRPC status");
        assert_eq!((status.code(), status.message()), (tonic::Code::NotFound, "answered by the second address"));
        assert!(started.elapsed() < within, "took {:?}", started.elapsed());
        assert_eq!(failover.current.load(Ordering::Relaxed), 1, "the next call starts at the address that answered");
    }

    /// A call with a deadline of its own gives up on the silent address after that deadline.
    #[tokio::test]
    async fn a_try_that_outlives_the_calls_deadline_moves_to_the_next_address() {
        let mut failover = silent_then_answering().await;
        answered_by_the_second_within(&mut failover, Some("300m"), Duration::from_secs(3)).await;
    }

    /// A call with no deadline gives up on the silent address when its pings go unanswered
    /// ([`KEEP_ALIVE_TIMEOUT`] after the first one, [`KEEP_ALIVE_INTERVAL`] in).
    #[tokio::test]
    async fn a_try_without_a_deadline_leaves_a_connection_whose_pings_go_unanswered() {
        let mut failover = silent_then_answering().await;
        let within = KEEP_ALIVE_INTERVAL + KEEP_ALIVE_TIMEOUT + Duration::from_secs(2);
        answered_by_the_second_within(&mut failover, None, within).await;
    }

    #[test]
    fn grpc_timeouts_are_read_as_tonic_writes_them() {
        let read = |v: &'static str| grpc_timeout(&http::HeaderValue::from_static(v));
        assert_eq!(read("300m"), Some(Duration::from_millis(300)));
        assert_eq!(read("2S"), Some(Duration::from_secs(2)));
        assert_eq!(read("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(read("5u"), Some(Duration::from_micros(5)));
        for bad in ["", "S", "123456789m", "10x", "-1S"] {
            assert_eq!(read(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_not_leader_answer_names_the_leader() {
        let named = answer(tonic::Status::unavailable("not the leader; the leader is 127.0.0.1:7001"));
        assert_eq!(not_leader(&named), Some(Some("127.0.0.1:7001".to_string())));
        let election = answer(tonic::Status::unavailable("not the leader; no leader is known yet"));
        assert_eq!(not_leader(&election), Some(None));
        assert_eq!(not_leader(&answer(tonic::Status::unavailable("storage server gone"))), None);
        assert_eq!(not_leader(&answer(tonic::Status::not_found("not the leader; the leader is x"))), None);
        assert_eq!(not_leader(&http::Response::new(Body::empty())), None);
    }
}
