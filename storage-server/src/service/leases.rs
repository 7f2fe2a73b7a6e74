//! Leases: the Lease and Release ops, which only a connection from the server's own host
//! (`tern_transport::local`) or an RDMA connection accepts.
//!
//! Over RDMA a lease is a memory window (`tern_transport::rdma_provider::OneSided`): bound over
//! exactly the block's bytes, remote read only, its key and the bytes' crc32c in the reply
//! ([`RemoteLease`]), so the client READs the block with no work of this server's. The
//! connection's pump holds the view until the window is invalidated (Release, [`LEASE_TTL`],
//! the connection's end) and that completed; windows per connection are bounded like leases
//! ([`MAX_LEASES_PER_CONNECTION`]), and every wait on the pump here has a deadline
//! ([`WINDOW_DEADLINE`]).
//!
//! A lease is a view of a DRAM block's published bytes (or of a Fetch page whose batches lie back
//! to back in one extent of the arena), held here so its slot is not reused (even if the block or
//! shuffle is freed) while the client reads the bytes straight from its read-only mapping of the
//! arena. Leases are bounded per connection, in number and in time ([`LEASE_TTL`]); all of a
//! connection's leases end with it.
//!
//! Every decision to lend or not is a [`LendOutcome`], counted per outcome in the server's
//! metrics (`tern_storage_lends_total{what, outcome}`) and logged at debug when bytes that could
//! have been lent were not: whether a read goes one-sided is never a silent accident of layout.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::Mutex;
use tern_proto::frame::{Frame, FrameError, Header, Lease, LentPage, RemoteLease, LEASE_TTL, MAX_RELEASE_IDS};
use tern_proto::{BlockId, ErrorKind};
use tern_transport::local::SharedArena;
use tern_transport::rdma_provider::{OneSided, Window};
use tern_transport::BoxRead;

use super::{error_reply, frame_error, read_request_payload, refuse, refuse_payload, Connection, Served};
use crate::shuffle::{FetchPage, PageLayout};
use crate::store::TierRef;

/// Most leases one connection holds at once. A client keeps at most 32 blocks leased; past this a
/// Lease is refused (Unavailable) and the client reads through the socket instead. Expired
/// leases end at the connection's next Lease (or with the connection).
pub(super) const MAX_LEASES_PER_CONNECTION: usize = 64;
/// How long a Lease or Release waits for the RDMA connection to bind or invalidate its windows
/// (microseconds normally); past it a Lease is refused (Unavailable: the client reads instead)
/// and a Release answers what completed. A window not confirmed invalidated keeps its pin.
const WINDOW_DEADLINE: Duration = Duration::from_secs(2);
/// How often expired same-host leases are ended (see [`LeaseBook`]): a lease's slot is back in
/// use at most this long after its [`LEASE_TTL`].
pub(super) const EXPIRY_TICK: Duration = Duration::from_secs(1);

/// Whether a Fetch page or a leased block was lent: each decision is counted by outcome
/// (`tern_storage_lends`) and a refusal logged at debug, so a reader that got bytes in a reply
/// where it expected a lend can find out why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum LendOutcome {
    Lent,
    NotLent(NotLent),
}

/// Why bytes went out in a reply instead of lent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum NotLent {
    #[error("nothing to lend (no bytes)")]
    Empty,
    #[error("the connection lends nothing (neither the server's own host nor RDMA)")]
    Transport,
    #[error("its batches are in several extents (gathered into a copy)")]
    Gathered,
    #[error("on NVMe (only DRAM is lent)")]
    OnNvme,
    #[error("the connection holds all the leases it may")]
    Limit,
    #[error("the transport refused: {0}")]
    Refused(String),
    #[error("no memory window bound within {WINDOW_DEADLINE:?}")]
    TimedOut,
}

impl LendOutcome {
    /// The outcome's metric label.
    pub(super) fn name(&self) -> &'static str {
        match self {
            LendOutcome::Lent => "lent",
            LendOutcome::NotLent(why) => match why {
                NotLent::Empty => "empty",
                NotLent::Transport => "transport",
                NotLent::Gathered => "gathered",
                NotLent::OnNvme => "nvme",
                NotLent::Limit => "limit",
                NotLent::Refused(_) => "refused",
                NotLent::TimedOut => "timed_out",
            },
        }
    }
}

/// What a connection lends through, if anything.
pub(super) enum Lender<'a> {
    /// Plain TCP, TLS or QUIC: nothing.
    None,
    /// The server's own host: offsets of the shared arena the client has mapped.
    Local(&'a Mutex<Leases>),
    /// RDMA: memory windows the client READs through.
    Rdma(Arc<dyn OneSided>),
}

impl Connection {
    pub(super) fn lender(&self) -> Lender<'_> {
        match (self.one_sided.clone(), self.leases.as_deref()) {
            (Some(one_sided), _) => Lender::Rdma(one_sided),
            (None, Some(leases)) => Lender::Local(leases),
            (None, None) => Lender::None,
        }
    }
}

/// A view lent: an offset of the shared arena, or a memory window.
enum Loan {
    Local(Lease),
    Remote(u64, Window),
}

/// Lends `view` through `lender`.
async fn lend(lender: Lender<'_>, view: Bytes) -> Result<Loan, NotLent> {
    match lender {
        Lender::None => Err(NotLent::Transport),
        Lender::Local(leases) => leases.lock().lend(view).map(Loan::Local),
        // A window covers at least a byte; there is nothing to READ anyway.
        Lender::Rdma(_) if view.is_empty() => Err(NotLent::Empty),
        Lender::Rdma(one_sided) => match tokio::time::timeout(WINDOW_DEADLINE, one_sided.lend(view, LEASE_TTL)).await {
            Ok(Ok((id, window))) => Ok(Loan::Remote(id, window)),
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::WouldBlock => Err(NotLent::Limit),
            Ok(Err(e)) => Err(NotLent::Refused(e.to_string())),
            Err(_) => Err(NotLent::TimedOut),
        },
    }
}

/// Every same-host connection's leases, so that expired ones end on a timer ([`EXPIRY_TICK`]),
/// not only at their connection's next Lease. A lent view holds its DRAM slot even once its
/// block is freed; a connection that stops leasing (a map that read its input and went on to
/// shuffle and write) kept such slots out of use for the rest of its life, and a DRAM tier full
/// of them refused new blocks (issue 31: 24 of 24 slots in use, 2 of them file blocks).
#[derive(Default)]
pub(super) struct LeaseBook(Mutex<Vec<Weak<Mutex<Leases>>>>);

impl LeaseBook {
    /// A new connection's lease table over `arena`, in the book.
    pub(super) fn open(&self, arena: Arc<SharedArena>) -> Arc<Mutex<Leases>> {
        let leases = Arc::new(Mutex::new(Leases::new(arena)));
        self.0.lock().push(Arc::downgrade(&leases));
        leases
    }

    /// Ends every lease past its TTL, and forgets closed connections; returns how many ended.
    pub(super) fn expire(&self, now: Instant) -> usize {
        let mut ended = 0;
        self.0.lock().retain(|leases| match leases.upgrade() {
            Some(leases) => {
                ended += leases.lock().expire(now);
                true
            }
            None => false,
        });
        ended
    }
}

/// One same-host connection's leases.
pub(super) struct Leases {
    arena: Arc<SharedArena>,
    held: HashMap<u64, (Bytes, Instant)>,
    next_id: u64,
}

impl Leases {
    pub(super) fn new(arena: Arc<SharedArena>) -> Leases {
        Leases { arena, held: HashMap::new(), next_id: 1 }
    }

    /// Lends `view`, unless it is not in the shared arena or this connection holds all the
    /// leases it may. Expired leases end first.
    fn lend(&mut self, view: Bytes) -> Result<Lease, NotLent> {
        let Some(offset) = self.arena.offset_of(&view) else {
            return Err(NotLent::Refused("its bytes are not in the shared arena".to_string()));
        };
        let now = Instant::now();
        self.expire(now);
        if self.held.len() >= MAX_LEASES_PER_CONNECTION {
            return Err(NotLent::Limit);
        }
        let id = self.next_id;
        self.next_id += 1;
        self.held.insert(id, (view, now));
        Ok(Lease { id, offset })
    }

    /// Ends the leases past their TTL at `now`; returns how many.
    fn expire(&mut self, now: Instant) -> usize {
        let before = self.held.len();
        self.held.retain(|_, (_, lent)| now.duration_since(*lent) < LEASE_TTL);
        before - self.held.len()
    }
}

/// A Fetch `page` as the reply to `h`: lent when the connection lends and the page is one view
/// of the arena (its batches back to back in one DRAM extent), so the client copies it from its
/// mapping or READs it through a memory window; carried in the reply otherwise. The outcome is
/// counted and a refusal logged.
pub(super) async fn reply_with_page(conn: &mut Connection, h: &Header, page: FetchPage) -> Frame {
    let reply = Frame::reply_with_crc(h, page.next_cursor, page.payload, page.crc);
    let (reply, outcome) = lend_page(conn.lender(), reply, page.layout).await;
    conn.metrics.lend("page", outcome.name());
    if let LendOutcome::NotLent(why) = &outcome {
        if *why != NotLent::Transport {
            tracing::debug!("block service: {h}: a {}-byte page not lent: {why}", reply.payload.len());
        }
    }
    reply
}

/// `reply` (a Fetch page laid out as `layout`) lent through `lender` where it can be.
async fn lend_page(lender: Lender<'_>, reply: Frame, layout: PageLayout) -> (Frame, LendOutcome) {
    let not_lent = match (&lender, layout) {
        _ if reply.payload.is_empty() => Some(NotLent::Empty),
        (Lender::None, _) => Some(NotLent::Transport),
        (_, PageLayout::Gathered) => Some(NotLent::Gathered),
        (_, PageLayout::Disk) => Some(NotLent::OnNvme),
        (_, PageLayout::Arena) => None,
    };
    if let Some(why) = not_lent {
        return (reply, LendOutcome::NotLent(why));
    }
    let (len, crc) = (reply.payload.len() as u32, reply.header.payload_crc);
    match lend(lender, reply.payload.clone()).await {
        Ok(Loan::Local(lease)) => (reply.lent(LentPage { lease, len, crc }), LendOutcome::Lent),
        Ok(Loan::Remote(id, window)) => {
            let lease = RemoteLease { id, addr: window.addr, rkey: window.rkey, len, crc };
            (reply.lent_with(lease.encode()), LendOutcome::Lent)
        }
        Err(why) => (reply, LendOutcome::NotLent(why)),
    }
}

/// Lends a DRAM block's published bytes; the reply's payload is the [`Lease`] (same host) or
/// [`RemoteLease`] (RDMA). The outcome is counted; a refusal is the reply.
pub(super) async fn lease(rd: &mut BoxRead, conn: &mut Connection, h: &Header) -> Result<Served, FrameError> {
    if h.payload_len > 0 {
        return refuse_payload(rd, h).await;
    }
    if conn.leases.is_none() && conn.one_sided.is_none() {
        conn.metrics.lend("block", LendOutcome::NotLent(NotLent::Transport).name());
        let message =
            format!("{h}: Lease is served only to clients on the server's own host (its local socket) or over RDMA");
        return refuse(rd, h, ErrorKind::Invalid, &message).await;
    }
    let block = BlockId::from_wire(h.block_id);
    let view = match conn.store.tier(block) {
        Ok(TierRef::Dram(dram)) => dram.read_published(block, conn.store.server_id()),
        Ok(TierRef::Nvme(_)) => {
            conn.metrics.lend("block", LendOutcome::NotLent(NotLent::OnNvme).name());
            let message = format!("{h}: block {block} is on NVMe; only DRAM blocks are lent (read it instead)");
            return Ok(Served::Reply(error_reply(h, ErrorKind::Invalid, &message), 0));
        }
        Err(e) => Err(e),
    };
    // A block this server does not hold (or may not serve) is refused as a Read of it would be.
    let (view, crc) = match view {
        Ok(read) => (read.data, read.crc),
        Err(e) => return Ok(Served::Reply(error_reply(h, e.kind(), &e.to_string()), 0)),
    };
    let len = view.len() as u32;
    let (reply, outcome) = match lend(conn.lender(), view.clone()).await {
        Ok(Loan::Local(lease)) => (Frame::reply(h, len, lease.encode()), LendOutcome::Lent),
        Ok(Loan::Remote(id, window)) => {
            let lease = RemoteLease { id, addr: window.addr, rkey: window.rkey, len, crc };
            (Frame::reply(h, len, lease.encode()), LendOutcome::Lent)
        }
        Err(why) => {
            let kind = if why == NotLent::Empty { ErrorKind::Invalid } else { ErrorKind::Unavailable };
            let refusal = error_reply(h, kind, &format!("{h}: block {block}: not lent ({why}); read it"));
            (refusal, LendOutcome::NotLent(why))
        }
    };
    conn.metrics.lend("block", outcome.name());
    Ok(Served::Reply(reply, 0))
}

/// Ends the leases a Release lists; the reply's length is how many were held.
pub(super) async fn release(rd: &mut BoxRead, conn: &mut Connection, h: &Header) -> Result<Served, FrameError> {
    if h.payload_len as usize > MAX_RELEASE_IDS * 8 {
        let err = FrameError::BadReleaseList { bytes: h.payload_len as usize };
        return refuse(rd, h, err.kind(), &format!("{h}: {err}")).await;
    }
    let payload = match read_request_payload(rd, h).await? {
        Ok(payload) => payload,
        Err(reply) => return Ok(Served::Reply(reply, 0)),
    };
    let request = Frame { header: *h, payload };
    let ids = match request.release_ids() {
        Ok(ids) => ids,
        Err(e) => return Ok(Served::Reply(frame_error(h, &e), 0)),
    };
    if let Some(one_sided) = conn.one_sided.clone() {
        // Each window invalidated, and that completed, before the reply counts it.
        let revokes = futures::future::join_all(ids.iter().map(|&id| one_sided.revoke(id)));
        let ended = match tokio::time::timeout(WINDOW_DEADLINE, revokes).await {
            Ok(done) => done.into_iter().filter(|r| matches!(r, Ok(true))).count(),
            Err(_) => {
                let why = format!("{h}: the windows were not invalidated within {WINDOW_DEADLINE:?}");
                return Ok(Served::Reply(error_reply(h, ErrorKind::Unavailable, &why), 0));
            }
        };
        return Ok(Served::Reply(Frame::reply(h, ended as u32, Bytes::new()), 0));
    }
    let Some(leases) = conn.leases.as_deref() else {
        let message =
            format!("{h}: Release is served only to clients on the server's own host (its local socket) or over RDMA");
        return Ok(Served::Reply(error_reply(h, ErrorKind::Invalid, &message), 0));
    };
    let mut leases = leases.lock();
    let ended = ids.iter().filter(|id| leases.held.remove(id).is_some()).count();
    Ok(Served::Reply(Frame::reply(h, ended as u32, Bytes::new()), 0))
}

#[cfg(test)]
mod tests {
    //! Every lend outcome, through a fake RDMA lender and a real same-host lease table: what the
    //! soft-RoCE guest check sees one-sided, decided here without a device.
    use std::io;

    use futures::future::BoxFuture;
    use futures::FutureExt;
    use tern_proto::shuffle::SegmentAddress;
    use tern_proto::{PartitionIndex, ShuffleId};

    use super::*;

    /// How the fake RDMA connection answers a bind.
    #[derive(Clone, Copy)]
    enum Bind {
        Ok,
        AllWindowsLent,
        Fails,
        Never,
    }

    struct FakeOneSided(Bind);

    impl OneSided for FakeOneSided {
        fn lend(&self, pin: Bytes, _ttl: Duration) -> BoxFuture<'_, io::Result<(u64, Window)>> {
            let answer = self.0;
            async move {
                match answer {
                    Bind::Ok => Ok((7, Window { addr: pin.as_ptr() as u64, rkey: 42 })),
                    Bind::AllWindowsLent => Err(io::Error::new(io::ErrorKind::WouldBlock, "all windows are lent")),
                    Bind::Fails => Err(io::Error::other("bind: range outside the registered arena")),
                    Bind::Never => futures::future::pending().await,
                }
            }
            .boxed()
        }

        fn revoke(&self, _id: u64) -> BoxFuture<'_, io::Result<bool>> {
            async { Ok(true) }.boxed()
        }

        fn read(&self, _window: Window, _len: usize) -> BoxFuture<'_, io::Result<Bytes>> {
            async { Err(io::Error::other("a server-side fake reads nothing")) }.boxed()
        }
    }

    fn page_reply(payload: &Bytes) -> Frame {
        let segment =
            SegmentAddress { shuffle: ShuffleId::from_wire(1), partition: PartitionIndex::from_wire(2), index: 0 };
        let request = Frame::fetch(9, segment, Bytes::new());
        Frame::reply_with_crc(&request.header, 5, payload.clone(), crc32c::crc32c(payload))
    }

    async fn lend_over_rdma(bind: Bind, payload: &Bytes, layout: PageLayout) -> (Frame, LendOutcome) {
        lend_page(Lender::Rdma(Arc::new(FakeOneSided(bind))), page_reply(payload), layout).await
    }

    #[tokio::test(start_paused = true)]
    async fn a_page_is_lent_or_carried_with_the_reason_why() {
        let payload = Bytes::from(vec![3u8; 4096]);
        let (lent, outcome) = lend_over_rdma(Bind::Ok, &payload, PageLayout::Arena).await;
        assert_eq!(outcome, LendOutcome::Lent);
        assert!(lent.is_lent());
        let lease = RemoteLease::decode(&lent.payload).unwrap();
        assert_eq!((lease.id, lease.rkey, lease.len, lease.crc), (7, 42, 4096, crc32c::crc32c(&payload)));
        assert_eq!(lent.header.length, 5, "the next cursor survives the lend");

        let carried = [
            (Bind::Ok, PageLayout::Gathered, NotLent::Gathered),
            (Bind::Ok, PageLayout::Disk, NotLent::OnNvme),
            (Bind::AllWindowsLent, PageLayout::Arena, NotLent::Limit),
            (Bind::Fails, PageLayout::Arena, NotLent::Refused("bind: range outside the registered arena".into())),
            (Bind::Never, PageLayout::Arena, NotLent::TimedOut),
        ];
        for (bind, layout, why) in carried {
            let (reply, outcome) = lend_over_rdma(bind, &payload, layout).await;
            assert_eq!(outcome, LendOutcome::NotLent(why.clone()), "{why}");
            assert!(!reply.is_lent() && reply.payload == payload, "{why}: carried whole");
        }
        let (reply, outcome) = lend_over_rdma(Bind::Ok, &Bytes::new(), PageLayout::Arena).await;
        assert_eq!((outcome, reply.is_lent()), (LendOutcome::NotLent(NotLent::Empty), false));
        let (reply, outcome) = lend_page(Lender::None, page_reply(&payload), PageLayout::Arena).await;
        assert_eq!((outcome, reply.is_lent()), (LendOutcome::NotLent(NotLent::Transport), false));
    }

    #[tokio::test]
    async fn a_same_host_page_is_lent_from_the_arena_within_the_connections_limit() {
        let arena = Bytes::from(vec![5u8; 1 << 20]);
        let book = LeaseBook::default();
        let leases = book.open(Arc::new(SharedArena::lent(arena.as_ptr(), arena.len())));
        let view = arena.slice(4096..8192);
        let (lent, outcome) = lend_page(Lender::Local(&leases), page_reply(&view), PageLayout::Arena).await;
        assert_eq!(outcome, LendOutcome::Lent);
        let page = LentPage::decode(&lent.payload).unwrap();
        assert_eq!((page.lease.offset, page.len, page.crc), (4096, 4096, crc32c::crc32c(&view)));

        let elsewhere = Bytes::from(vec![5u8; 16]);
        let (_, outcome) = lend_page(Lender::Local(&leases), page_reply(&elsewhere), PageLayout::Arena).await;
        assert!(matches!(outcome, LendOutcome::NotLent(NotLent::Refused(_))), "{outcome:?}");

        for _ in 1..MAX_LEASES_PER_CONNECTION {
            let (_, outcome) = lend_page(Lender::Local(&leases), page_reply(&view), PageLayout::Arena).await;
            assert_eq!(outcome, LendOutcome::Lent);
        }
        let (reply, outcome) = lend_page(Lender::Local(&leases), page_reply(&view), PageLayout::Arena).await;
        assert_eq!((outcome, reply.is_lent()), (LendOutcome::NotLent(NotLent::Limit), false));

        // Expired leases end on the book's tick, with no further Lease on the connection, and
        // let their views (and so their slots) go.
        assert_eq!(book.expire(Instant::now()), 0, "none expired yet");
        assert_eq!(book.expire(Instant::now() + LEASE_TTL), MAX_LEASES_PER_CONNECTION);
        assert!(leases.lock().held.is_empty());
        drop(leases);
        assert_eq!((book.expire(Instant::now()), book.0.lock().len()), (0, 0), "a closed connection is forgotten");
    }

    #[test]
    fn each_outcome_has_its_own_metric_label() {
        let outcomes = [
            LendOutcome::Lent,
            LendOutcome::NotLent(NotLent::Empty),
            LendOutcome::NotLent(NotLent::Transport),
            LendOutcome::NotLent(NotLent::Gathered),
            LendOutcome::NotLent(NotLent::OnNvme),
            LendOutcome::NotLent(NotLent::Limit),
            LendOutcome::NotLent(NotLent::Refused(String::new())),
            LendOutcome::NotLent(NotLent::TimedOut),
        ];
        let names: std::collections::HashSet<&str> = outcomes.iter().map(LendOutcome::name).collect();
        assert_eq!(names.len(), outcomes.len());
    }
}
