//! Same-host block connections: a client on a storage server's host reads its DRAM blocks without
//! a network socket.
//!
//! The storage server listens on a Unix socket in the abstract namespace named after its block
//! address ([`socket_name`]). Abstract sockets belong to a network namespace, so this path is
//! found exactly where the server's own address would be reached without a network in between:
//! a client in another namespace (another "host" of the multi-host tests) never finds it and
//! uses the network as before.
//!
//! On accept the server checks the peer's credentials (`SO_PEERCRED`: the same user as the server,
//! or root, which could read the server's memory through `/proc` anyway) and sends it a read-only
//! descriptor of its DRAM arena (a memfd, `SCM_RIGHTS`) with the arena's length. The client maps
//! it read-only ([`SharedArena`]). The connection then carries block frames like any other, and
//! two ops that only it accepts (see `tern_proto::frame::Op::Lease`): the client leases a block
//! (authorized as a read of it), the server pins the block's slot and answers with where it lies
//! in the arena, and the client reads it there, with no request at all, until it releases the
//! lease or the lease's time is up.
//!
//! Writes skip the socket too. With the arena the server hands each connection a staging area of
//! its own ([`Staging`]: a memfd both map read-write, sealed at its size so the client cannot shrink
//! it under the server). The client copies a Write's payload into it and sends a `WriteStaged`
//! naming where; the server copies the bytes from there into the block, taking their crc32c on its
//! copy, and only then publishes them. So a client never holds a writable view of any block (its
//! own included, which it could otherwise change after the check), nor sees another
//! connection's staging area; what it changes in its own while the server copies can only spoil
//! its own write, which the crc check then refuses.

#![allow(unsafe_code)] // reading the shared mapping: memory outside Rust's model, guarded by leases

use std::io;
use std::mem::MaybeUninit;
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::sync::Arc;

use futures::future::BoxFuture;
use memmap2::{MmapOptions, MmapRaw};
use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage};
use tokio::io::Interest;
use tokio::net::UnixStream;

use crate::{Connector, Listener, Stream};

/// The first bytes the server sends on a same-host connection, with the arena's and the staging
/// area's descriptors: the magic, then the two lengths (u64 little-endian each).
const HELLO_MAGIC: [u8; 8] = *b"TERNARN2";
const HELLO_LEN: usize = 24;

/// What a same-host connection carries beside its byte stream, on both ends.
pub struct SameHost {
    /// The server's DRAM arena, which the client reads leased blocks from directly.
    pub arena: Arc<SharedArena>,
    /// This connection's staging area, which the client writes payloads into.
    pub staging: Arc<Staging>,
}

/// The abstract socket a storage server whose block service is at `addr` (`host:port`, as it
/// registers it) listens on for clients of its own host.
pub fn socket_name(addr: &str) -> String {
    format!("tern-block/{addr}")
}

/// A storage server's DRAM arena as seen over a same-host connection: on the server, its own
/// mapping (used only to tell whether a reply's bytes lie in it); on the client, the server's
/// memfd mapped read-only.
pub struct SharedArena {
    base: *const u8,
    len: usize,
    /// The client's mapping; `None` on the server (the arena owns its own).
    _map: Option<MmapRaw>,
}

// SAFETY: the base pointer is only read through `copy_out`, whose bounds and lease discipline
// hold on any thread; the mapping itself is process-wide.
unsafe impl Send for SharedArena {}
// SAFETY: as for Send: nothing is mutated through a `&SharedArena`.
unsafe impl Sync for SharedArena {}

impl SharedArena {
    /// The server's view of its own arena: `len` bytes at `base`, valid while the server runs.
    pub fn lent(base: *const u8, len: usize) -> SharedArena {
        SharedArena { base, len, _map: None }
    }

    /// Maps the server's arena descriptor read-only.
    fn map(fd: &OwnedFd, len: usize) -> io::Result<SharedArena> {
        let file = std::fs::File::from(fd.try_clone()?);
        let actual = file.metadata()?.len();
        if actual != len as u64 {
            return Err(io::Error::other(format!("the server's arena is {actual} bytes, its hello said {len}")));
        }
        let map = MmapOptions::new().len(len).map_raw_read_only(&file)?;
        Ok(SharedArena { base: map.as_ptr(), len, _map: Some(map) })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where `bytes` start in the arena, if all of them lie in it.
    pub fn offset_of(&self, bytes: &[u8]) -> Option<u64> {
        let start = (bytes.as_ptr() as usize).checked_sub(self.base as usize)?;
        (start.checked_add(bytes.len())? <= self.len).then_some(start as u64)
    }

    /// Copies `len` bytes at `offset` of the arena into a new buffer. The caller holds a lease on
    /// those bytes (the server does not reuse them meanwhile); bytes outside the arena are an
    /// error, never read.
    pub fn copy_out(&self, offset: u64, len: usize) -> io::Result<bytes::Bytes> {
        let in_bounds =
            usize::try_from(offset).ok().and_then(|start| start.checked_add(len)).is_some_and(|end| end <= self.len);
        if !in_bounds {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{len} bytes at {offset} lie outside the server's {}-byte arena", self.len),
            ));
        }
        let mut out = bytes::BytesMut::with_capacity(len);
        // SAFETY: [offset, offset + len) lies in the mapping (checked above), which lives as long
        // as `self`; `out` has `len` bytes of capacity and does not overlap it. The server writes
        // to a slot only before it is published and after every lease on it is released, so no
        // byte copied here changes meanwhile (another process's writes are outside Rust's model
        // anyway: a byte copy is all that touches them).
        unsafe {
            std::ptr::copy_nonoverlapping(self.base.add(offset as usize), out.as_mut_ptr(), len);
            out.set_len(len);
        }
        Ok(out.freeze())
    }
}

/// A same-host connection's staging area (see the module doc): a shared mapping of a memfd made
/// for one connection, sealed at its size.
pub struct Staging {
    base: *mut u8,
    len: usize,
    _map: MmapRaw,
}

// SAFETY: the mapping is process-wide and only touched through `stage` and `copy_out`, byte copies
// within bounds they check.
unsafe impl Send for Staging {}
// SAFETY: as for Send; callers of `stage` own the range they write (see there).
unsafe impl Sync for Staging {}

impl Staging {
    /// The server's side: a new staging area of `len` bytes, and the descriptor to hand over.
    fn create(len: usize) -> io::Result<(Staging, OwnedFd)> {
        use rustix::fs::{MemfdFlags, SealFlags};
        let fd = rustix::fs::memfd_create("tern-staging", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
        let file = std::fs::File::from(fd);
        file.set_len(len as u64)?;
        // Sealed at its size: a client shrinking it would make the server's copies fault.
        rustix::fs::fcntl_add_seals(&file, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
        let staging = Staging::map(&file, len)?;
        Ok((staging, OwnedFd::from(file)))
    }

    /// Maps `file`, `len` bytes, read-write and shared.
    fn map(file: &std::fs::File, len: usize) -> io::Result<Staging> {
        let actual = file.metadata()?.len();
        if actual != len as u64 {
            return Err(io::Error::other(format!("the staging area is {actual} bytes, the hello said {len}")));
        }
        let map = MmapOptions::new().len(len).map_raw(file)?;
        Ok(Staging { base: map.as_mut_ptr(), len, _map: map })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether `len` bytes at `at` lie in the area: an error saying why not.
    pub fn check(&self, at: u64, len: usize) -> io::Result<()> {
        self.range(at, len).map(|_| ())
    }

    /// Where `len` bytes at `at` start, if they lie in the area.
    fn range(&self, at: u64, len: usize) -> io::Result<usize> {
        usize::try_from(at).ok().filter(|start| start.checked_add(len).is_some_and(|end| end <= self.len)).ok_or_else(
            || {
                let why = format!("{len} bytes at {at} lie outside the {}-byte staging area", self.len);
                io::Error::new(io::ErrorKind::InvalidInput, why)
            },
        )
    }

    /// The client's side: copies `data` to `at` and returns its crc32c, taken a piece at a time
    /// right after each piece is copied, while it is in cache. The caller owns `[at, at + len)`
    /// until the server has answered the write staged there.
    pub fn stage(&self, at: u64, data: &[u8]) -> io::Result<u32> {
        let start = self.range(at, data.len())?;
        let mut crc = 0;
        for (i, piece) in data.chunks(STAGE_PIECE).enumerate() {
            // SAFETY: the range lies in the mapping (checked above), which lives as long as
            // `self`; this client owns it (no other write of its own is staged there), and the
            // server only reads it. `data` is not in the mapping.
            unsafe {
                std::ptr::copy_nonoverlapping(piece.as_ptr(), self.base.add(start + i * STAGE_PIECE), piece.len());
            }
            crc = crc32c::crc32c_append(crc, piece);
        }
        Ok(crc)
    }

    /// The server's side: copies the `out.len()` bytes at `at` into `out`. Bytes outside the area
    /// are an error, never read.
    pub fn copy_out(&self, at: u64, out: &mut [u8]) -> io::Result<()> {
        let start = self.range(at, out.len())?;
        // SAFETY: the range lies in the mapping (checked above); `out` is the server's own memory,
        // not in it. The client may change these bytes meanwhile (another process, outside Rust's
        // model: a byte copy is all that touches them); the caller checks the crc of its copy.
        unsafe { std::ptr::copy_nonoverlapping(self.base.add(start), out.as_mut_ptr(), out.len()) };
        Ok(())
    }
}

/// How much of a staged payload is copied before its crc is taken: small enough to still be in
/// the first-level cache.
const STAGE_PIECE: usize = 16 << 10;

/// The server side: accepts same-host clients and hands each the arena's descriptor.
pub struct LocalListener {
    listener: tokio::net::UnixListener,
    /// A read-only descriptor of the arena: clients can map it, not write through it.
    arena_fd: OwnedFd,
    arena: Arc<SharedArena>,
    /// Bytes of each connection's staging area.
    staging_len: usize,
    /// The block address the socket is named after, given as each stream's peer (a Unix peer
    /// has no IP address).
    addr: SocketAddr,
}

impl LocalListener {
    /// Listens on [`socket_name`]`(addr)`; `arena_fd` is the arena's memfd (reopened read-only
    /// here) and `arena` the server's view of it; each connection gets a staging area of
    /// `staging_len` bytes.
    pub fn bind(
        addr: SocketAddr,
        advertised: &str,
        arena_fd: &OwnedFd,
        arena: SharedArena,
        staging_len: usize,
    ) -> io::Result<LocalListener> {
        let name = socket_name(advertised);
        let at = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
        let std_listener = std::os::unix::net::UnixListener::bind_addr(&at)?;
        std_listener.set_nonblocking(true)?;
        let listener = tokio::net::UnixListener::from_std(std_listener)?;
        let arena_fd = read_only(arena_fd)?;
        Ok(LocalListener { listener, arena_fd, arena: Arc::new(arena), staging_len, addr })
    }

    /// The next client that passes the handshake; one that does not is logged and closed, and
    /// does not hold up the accept loop.
    async fn accept_one(&mut self) -> io::Result<Stream> {
        loop {
            let (stream, _) = self.listener.accept().await?;
            match self.handshake(stream) {
                Ok(stream) => return Ok(stream),
                Err(e) => tracing::warn!("same-host block socket: refused a client: {e}"),
            }
        }
    }

    /// Checks the client's user and sends it the hello with the arena's descriptor and a new
    /// staging area's.
    fn handshake(&self, stream: UnixStream) -> io::Result<Stream> {
        let peer = rustix::net::sockopt::socket_peercred(&stream)?;
        let me = rustix::process::geteuid();
        if peer.uid != me && !peer.uid.is_root() {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "same-host client (pid {}) runs as user {}, not the server's {}",
                    peer.pid.as_raw_nonzero(),
                    peer.uid.as_raw(),
                    me.as_raw()
                ),
            ));
        }
        let (staging, staging_fd) = Staging::create(self.staging_len)?;
        let mut hello = [0u8; HELLO_LEN];
        hello[..8].copy_from_slice(&HELLO_MAGIC);
        hello[8..16].copy_from_slice(&(self.arena.len() as u64).to_le_bytes());
        hello[16..].copy_from_slice(&(self.staging_len as u64).to_le_bytes());
        let fds = [self.arena_fd.as_fd(), staging_fd.as_fd()];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        control.push(SendAncillaryMessage::ScmRights(&fds));
        // A fresh socket's buffer takes 16 bytes at once; anything else is the peer's problem.
        let sent = stream.try_io(Interest::WRITABLE, || {
            rustix::net::sendmsg(&stream, &[io::IoSlice::new(&hello)], &mut control, rustix::net::SendFlags::NOSIGNAL)
                .map_err(io::Error::from)
        })?;
        if sent != HELLO_LEN {
            return Err(io::Error::other(format!("sent {sent} of the {HELLO_LEN}-byte hello")));
        }
        let (reader, writer) = stream.into_split();
        Ok(Stream {
            reader: Box::new(reader),
            writer: Box::new(writer),
            peer: self.addr,
            local: Some(SameHost { arena: self.arena.clone(), staging: Arc::new(staging) }),
            one_sided: None,
        })
    }
}

impl Listener for LocalListener {
    fn accept(&mut self) -> BoxFuture<'_, io::Result<Stream>> {
        Box::pin(self.accept_one())
    }

    fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    fn name(&self) -> &'static str {
        "local"
    }
}

/// A read-only descriptor of the file `fd` is open on (a memfd: through /proc, the one way to
/// drop write access to it).
fn read_only(fd: &OwnedFd) -> io::Result<OwnedFd> {
    let path = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(fd));
    let file = std::fs::OpenOptions::new().read(true).open(&path)?;
    Ok(file.into())
}

/// The client side: dials the same-host socket of the storage server at `addr`. A server on
/// another host (or one without a same-host socket) refuses at once with `ConnectionRefused`.
#[derive(Debug, Default, Clone, Copy)]
pub struct LocalConnector;

impl LocalConnector {
    pub async fn dial(&self, addr: &str) -> io::Result<Stream> {
        let name = socket_name(addr);
        let at = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
        // A Unix connect completes (or is refused) at once.
        let std_stream = std::os::unix::net::UnixStream::connect_addr(&at)?;
        std_stream.set_nonblocking(true)?;
        let stream = UnixStream::from_std(std_stream)?;
        let hello = receive_hello(&stream).await?;
        let arena = SharedArena::map(&hello.arena_fd, hello.arena_len)?;
        let staging = Staging::map(&std::fs::File::from(hello.staging_fd), hello.staging_len)?;
        let peer = addr.parse().unwrap_or(SocketAddr::from(([127, 0, 0, 1], 0)));
        let (reader, writer) = stream.into_split();
        Ok(Stream {
            reader: Box::new(reader),
            writer: Box::new(writer),
            peer,
            local: Some(SameHost { arena: Arc::new(arena), staging: Arc::new(staging) }),
            one_sided: None,
        })
    }
}

impl Connector for LocalConnector {
    fn connect<'a>(&'a self, addr: &'a str) -> BoxFuture<'a, io::Result<Stream>> {
        Box::pin(self.dial(addr))
    }
}

/// What the server's hello says: its arena and this connection's staging area.
struct Hello {
    arena_len: usize,
    arena_fd: OwnedFd,
    staging_len: usize,
    staging_fd: OwnedFd,
}

/// Reads the server's hello.
async fn receive_hello(stream: &UnixStream) -> io::Result<Hello> {
    let mut hello = [0u8; HELLO_LEN];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
    loop {
        stream.readable().await?;
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let received = stream.try_io(Interest::READABLE, || {
            rustix::net::recvmsg(stream, &mut [io::IoSliceMut::new(&mut hello)], &mut control, RecvFlags::CMSG_CLOEXEC)
                .map_err(io::Error::from)
        });
        let received = match received {
            Ok(received) => received,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        };
        let mut fds: Vec<OwnedFd> = control
            .drain()
            .flat_map(|message| match message {
                RecvAncillaryMessage::ScmRights(fds) => fds.collect(),
                _ => Vec::new(),
            })
            .collect();
        if received.bytes != HELLO_LEN || hello[..8] != HELLO_MAGIC {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "the same-host socket did not send a Tern hello"));
        }
        if fds.len() != 2 {
            let why = format!("the hello carried {} descriptors, not the arena's and the staging area's", fds.len());
            return Err(io::Error::new(io::ErrorKind::InvalidData, why));
        }
        let length = |at: usize| {
            let len = u64::from_le_bytes(hello[at..at + 8].try_into().expect("8 bytes"));
            usize::try_from(len).map_err(|_| io::Error::other("a shared area exceeds the address space"))
        };
        let (staging_fd, arena_fd) = (fds.pop().expect("two"), fds.pop().expect("two"));
        return Ok(Hello { arena_len: length(8)?, arena_fd, staging_len: length(16)?, staging_fd });
    }
}

/// The client side of `--transport auto`: the same-host socket of a storage server on this host,
/// else `inner` (a server elsewhere refuses at once, costing one failed Unix connect).
pub struct LocalFirst<C> {
    inner: C,
}

impl<C: Connector> LocalFirst<C> {
    pub fn new(inner: C) -> LocalFirst<C> {
        LocalFirst { inner }
    }
}

impl<C: Connector> Connector for LocalFirst<C> {
    fn connect<'a>(&'a self, addr: &'a str) -> BoxFuture<'a, io::Result<Stream>> {
        Box::pin(async move {
            match LocalConnector.dial(addr).await {
                Ok(stream) => Ok(stream),
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => self.inner.connect(addr).await,
                Err(e) => {
                    tracing::warn!("storage server {addr}: its same-host socket failed ({e}); using the network");
                    self.inner.connect(addr).await
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_staging_area_is_sealed_at_its_size_and_bounds_every_copy() {
        let (server, fd) = Staging::create(1 << 20).unwrap();
        let file = std::fs::File::from(fd);
        // The client gets this descriptor: it can neither shrink the area under the server's
        // copies (which would fault) nor grow it.
        assert!(file.set_len(4096).is_err(), "the staging area could be shrunk");
        assert!(file.set_len(2 << 20).is_err(), "the staging area could be grown");
        let client = Staging::map(&file, 1 << 20).unwrap();
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        assert_eq!(client.stage(5, &data).unwrap(), crc32c::crc32c(&data));
        let mut copy = vec![0; data.len()];
        server.copy_out(5, &mut copy).unwrap();
        assert_eq!(copy, data, "the server sees what the client staged");
        assert!(client.stage((1 << 20) - 10, &data).is_err());
        assert!(server.copy_out(u64::MAX, &mut copy).is_err());
        assert!(server.check((1 << 20) - 1, 2).is_err() && server.check((1 << 20) - 1, 1).is_ok());
    }
}
