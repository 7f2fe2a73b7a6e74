//! Every call into libibverbs and librdmacm, and the only unsafe code of the RDMA transport.
//!
//! Each [`Endpoint`] is owned by one thread (its pump, in `super`), which alone touches its queue
//! pair, completion queues and registered buffers: nothing here is shared between threads except
//! by moving the whole endpoint. The raw handles are freed exactly once, in `Drop`.

use std::ffi::{CStr, CString};
use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::raw::c_int;
use std::ptr;
use std::sync::Arc;

use rdma_sys::*;

/// Send and receive slots per connection (each way): the queue depths, and with [`SLOT_BYTES`]
/// the registered memory of one connection (2 x 16 x 64 KiB = 2 MiB).
pub(crate) const SLOTS: usize = 16;
/// Bytes one SEND carries at most; a block frame of 1 MiB goes as 16 of them.
pub(crate) const SLOT_BYTES: usize = 64 << 10;
/// Send-queue entries kept for one-sided work beside the [`SLOTS`] SENDs: window binds and
/// invalidations on a server, RDMA READs on a client. More waits in the pump.
pub(crate) const ONE_SIDED_WRS: usize = 16;
/// A client's READ destination: [`READ_SLOTS`] slots of [`READ_SLOT_BYTES`], registered on its
/// first READ (4 MiB per connection that reads one-sided); a longer READ goes in pieces.
pub(crate) const READ_SLOTS: usize = 4;
pub(crate) const READ_SLOT_BYTES: usize = 1 << 20;
/// Most memory windows one connection binds at once: the server's bound on leases per
/// connection.
pub(crate) const MAX_WINDOWS: usize = 64;

/// The RDMA devices of this host, by name (`rxe0`, `mlx5_0`); empty when there is none.
pub(crate) fn device_names() -> io::Result<Vec<String>> {
    let mut count: c_int = 0;
    // SAFETY: `count` is a valid out-pointer; the list returned is freed below, after its
    // entries' names were copied out.
    let list = unsafe { ibv_get_device_list(&mut count) };
    if list.is_null() {
        let e = io::Error::last_os_error();
        // ENOSYS: no kernel support at all (no ib_uverbs), which is "no device" too.
        return if e.raw_os_error() == Some(libc::ENOSYS) { Ok(Vec::new()) } else { Err(e) };
    }
    let mut names = Vec::new();
    for i in 0..usize::try_from(count).unwrap_or(0) {
        // SAFETY: the list holds `count` valid device pointers.
        let name = unsafe { ibv_get_device_name(*list.add(i)) };
        if !name.is_null() {
            // SAFETY: a device name is a NUL-terminated string owned by the list.
            names.push(unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned());
        }
    }
    // SAFETY: `list` came from ibv_get_device_list and is freed once.
    unsafe { ibv_free_device_list(list) };
    Ok(names)
}

/// The last librdmacm/libibverbs error (they set errno), naming what failed.
fn failed(what: &str) -> io::Error {
    let e = io::Error::last_os_error();
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// Queue pair attributes shared by both ends: reliable connected, [`SLOTS`] deep each way, one
/// scatter entry per request, every send signalled (its slot is free again on completion); the
/// send queue has [`ONE_SIDED_WRS`] more entries for one-sided work.
fn qp_attr() -> ibv_qp_init_attr {
    // SAFETY: ibv_qp_init_attr is a plain C struct for which all zeroes is valid (null CQs ask
    // rdma_create_ep to make them).
    let mut attr: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
    attr.cap.max_send_wr = (SLOTS + ONE_SIDED_WRS) as u32;
    attr.cap.max_recv_wr = SLOTS as u32;
    attr.cap.max_send_sge = 1;
    attr.cap.max_recv_sge = 1;
    attr.qp_type = ibv_qp_type::IBV_QPT_RC;
    attr.sq_sig_all = 1;
    attr
}

/// rdma_getaddrinfo for `host:port` in the TCP port space (`passive` for a listener).
struct AddrInfo(*mut rdma_addrinfo);

impl AddrInfo {
    fn resolve(addr: SocketAddr, passive: bool) -> io::Result<AddrInfo> {
        let host = CString::new(addr.ip().to_string()).expect("an IP address has no NUL");
        let port = CString::new(addr.port().to_string()).expect("a port has no NUL");
        // SAFETY: all zeroes is a valid rdma_addrinfo hint (no flags, any family).
        let mut hints: rdma_addrinfo = unsafe { std::mem::zeroed() };
        hints.ai_port_space = rdma_port_space::RDMA_PS_TCP as c_int;
        if passive {
            hints.ai_flags = RAI_PASSIVE as c_int;
        }
        let mut res: *mut rdma_addrinfo = ptr::null_mut();
        // SAFETY: the strings and hints outlive the call; `res` is an out-pointer freed in Drop.
        let rc = unsafe { rdma_getaddrinfo(host.as_ptr(), port.as_ptr(), &hints, &mut res) };
        if rc != 0 || res.is_null() {
            return Err(failed(&format!("resolving {addr} for RDMA")));
        }
        Ok(AddrInfo(res))
    }
}

impl Drop for AddrInfo {
    fn drop(&mut self) {
        // SAFETY: the pointer came from rdma_getaddrinfo and is freed once.
        unsafe { rdma_freeaddrinfo(self.0) };
    }
}

/// A listening rdma_cm id (synchronous: [`CmListener::get_request`] blocks).
pub(crate) struct CmListener {
    id: *mut rdma_cm_id,
}

// SAFETY: the id is used by one thread at a time (the listener's accept thread owns it).
unsafe impl Send for CmListener {}

impl CmListener {
    pub(crate) fn bind(addr: SocketAddr, backlog: c_int) -> io::Result<CmListener> {
        let info = AddrInfo::resolve(addr, true)?;
        let mut attr = qp_attr();
        let mut id: *mut rdma_cm_id = ptr::null_mut();
        // SAFETY: `info.0` is a valid addrinfo; `attr` is kept by librdmacm as the template for
        // the queue pairs of accepted ids; `id` is an out-pointer, destroyed in Drop.
        if unsafe { rdma_create_ep(&mut id, info.0, ptr::null_mut(), &mut attr) } != 0 {
            return Err(failed(&format!("creating an RDMA listener on {addr}")));
        }
        let listener = CmListener { id };
        // SAFETY: `id` is a valid passive id.
        if unsafe { rdma_listen(listener.id, backlog) } != 0 {
            return Err(failed(&format!("listening for RDMA on {addr}")));
        }
        Ok(listener)
    }

    /// The next connection request, its queue pair made, not yet accepted.
    pub(crate) fn get_request(&self) -> io::Result<Request> {
        let mut id: *mut rdma_cm_id = ptr::null_mut();
        // SAFETY: `self.id` is a valid listening id; `id` is an out-pointer.
        if unsafe { rdma_get_request(self.id, &mut id) } != 0 || id.is_null() {
            return Err(failed("waiting for an RDMA connection request"));
        }
        Ok(Request { id })
    }
}

impl Drop for CmListener {
    fn drop(&mut self) {
        // SAFETY: the id came from rdma_create_ep and is destroyed once.
        unsafe { rdma_destroy_ep(self.id) };
    }
}

/// A connection request taken from a listener: accept or reject it.
pub(crate) struct Request {
    id: *mut rdma_cm_id,
}

// SAFETY: the id is owned by whichever thread holds the request.
unsafe impl Send for Request {}

impl Request {
    /// Registers the connection's buffers, posts its receives and accepts (blocking until the
    /// connection is established).
    /// With `lendable`, the endpoint gets the region registered on its protection domain, to
    /// bind memory windows over (without: it lends nothing, logged once per device).
    pub(crate) fn accept(mut self, lendable: Option<&Lendable>) -> io::Result<Endpoint> {
        let id = std::mem::replace(&mut self.id, ptr::null_mut());
        let mut endpoint = Endpoint::new(id)?;
        if let Some(lendable) = lendable {
            // SAFETY: the id has its queue pair (made by rdma_get_request); its pd is valid.
            let pd = unsafe { (*(*id).qp).pd };
            match lendable.region_on(pd) {
                Ok(region) => endpoint.region = Some(region),
                Err(e) => tracing::warn!("RDMA: {e}; this connection lends nothing (reads go two-sided)"),
            }
        }
        endpoint.post_all_receives()?;
        let mut param = conn_param();
        // SAFETY: `id` is a connection request's id with a queue pair; param outlives the call.
        if unsafe { rdma_accept(endpoint.id, &mut param) } != 0 {
            return Err(failed("accepting an RDMA connection"));
        }
        endpoint.watch_events()?;
        Ok(endpoint)
    }

    pub(crate) fn reject(self) {
        // The id is destroyed by Drop.
        // SAFETY: `self.id` is a valid connection request's id.
        unsafe { rdma_reject(self.id, ptr::null(), 0) };
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        if !self.id.is_null() {
            // SAFETY: the id came from rdma_get_request and is destroyed once.
            unsafe { rdma_destroy_ep(self.id) };
        }
    }
}

/// Reliable-connection parameters: transport retries bounded (a dead peer errors the queue pair
/// within seconds), receiver-not-ready retried without limit (7), which is the flow control: a
/// sender whose peer has no receive posted waits for one instead of failing.
fn conn_param() -> rdma_conn_param {
    // SAFETY: all zeroes is a valid rdma_conn_param (no private data).
    let mut param: rdma_conn_param = unsafe { std::mem::zeroed() };
    param.responder_resources = 1;
    param.initiator_depth = 1;
    param.retry_count = 7;
    param.rnr_retry_count = 7;
    param
}

/// Dials `addr` over RDMA (blocking until connected or refused).
pub(crate) fn connect(addr: SocketAddr) -> io::Result<Endpoint> {
    let info = AddrInfo::resolve(addr, false)?;
    let mut attr = qp_attr();
    let mut id: *mut rdma_cm_id = ptr::null_mut();
    // SAFETY: as in CmListener::bind, for an active id (its queue pair made now).
    if unsafe { rdma_create_ep(&mut id, info.0, ptr::null_mut(), &mut attr) } != 0 {
        return Err(failed(&format!("creating an RDMA endpoint for {addr}")));
    }
    let mut endpoint = Endpoint::new(id)?;
    endpoint.post_all_receives()?;
    let mut param = conn_param();
    // SAFETY: `id` is a valid active id with a queue pair; param outlives the call.
    if unsafe { rdma_connect(endpoint.id, &mut param) } != 0 {
        return Err(failed(&format!("RDMA connect to {addr}")));
    }
    endpoint.watch_events()?;
    Ok(endpoint)
}

/// One completion taken from a completion queue: its work request's id (a send or receive
/// slot, or a one-sided op's tag, see `stream`) and the bytes received.
pub(crate) struct Completion {
    pub(crate) slot: usize,
    pub(crate) bytes: usize,
}

/// A connected queue pair with its registered send and receive buffers.
pub(crate) struct Endpoint {
    id: *mut rdma_cm_id,
    /// After connecting, the id's events (a disconnect) arrive here, read without blocking.
    events: *mut rdma_event_channel,
    send_buf: Box<[u8]>,
    recv_buf: Box<[u8]>,
    send_mr: *mut ibv_mr,
    recv_mr: *mut ibv_mr,
    /// A server's lendable region, registered on this endpoint's protection domain.
    region: Option<Arc<Region>>,
    /// A server's memory windows (type 2, this queue pair's to bind), allocated as needed up to
    /// [`MAX_WINDOWS`]; deallocated in Drop before the queue pair goes.
    windows: Vec<*mut ibv_mw>,
    /// A client's READ destination, registered on its first READ.
    read_buf: Box<[u8]>,
    read_mr: *mut ibv_mr,
}

// SAFETY: an endpoint is used by one thread at a time (moved to its pump thread whole).
unsafe impl Send for Endpoint {}

impl Endpoint {
    fn new(id: *mut rdma_cm_id) -> io::Result<Endpoint> {
        let mut endpoint = Endpoint {
            id,
            events: ptr::null_mut(),
            send_buf: vec![0u8; SLOTS * SLOT_BYTES].into_boxed_slice(),
            recv_buf: vec![0u8; SLOTS * SLOT_BYTES].into_boxed_slice(),
            send_mr: ptr::null_mut(),
            recv_mr: ptr::null_mut(),
            region: None,
            windows: Vec::new(),
            read_buf: Box::default(),
            read_mr: ptr::null_mut(),
        };
        // SAFETY: the buffers are heap slices owned by the endpoint, which deregisters them in
        // Drop before they are freed; their addresses do not move.
        endpoint.send_mr = unsafe { rdma_reg_msgs(id, endpoint.send_buf.as_mut_ptr().cast(), endpoint.send_buf.len()) };
        if endpoint.send_mr.is_null() {
            return Err(failed("registering RDMA send buffers"));
        }
        // SAFETY: as above.
        endpoint.recv_mr = unsafe { rdma_reg_msgs(id, endpoint.recv_buf.as_mut_ptr().cast(), endpoint.recv_buf.len()) };
        if endpoint.recv_mr.is_null() {
            return Err(failed("registering RDMA receive buffers"));
        }
        Ok(endpoint)
    }

    fn post_all_receives(&mut self) -> io::Result<()> {
        (0..SLOTS).try_for_each(|slot| self.post_receive(slot))
    }

    /// Moves the id's events to a channel of its own, read without blocking by
    /// [`Endpoint::disconnected`].
    fn watch_events(&mut self) -> io::Result<()> {
        // SAFETY: plain constructor; the channel is destroyed in Drop after the id.
        let channel = unsafe { rdma_create_event_channel() };
        if channel.is_null() {
            return Err(failed("creating an RDMA event channel"));
        }
        self.events = channel;
        // SAFETY: `channel` is a valid event channel; `fd` is its file descriptor.
        let fd = unsafe { (*channel).fd };
        // SAFETY: fcntl on a descriptor this endpoint owns.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: as above.
        if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
            return Err(failed("making the RDMA event channel non-blocking"));
        }
        // SAFETY: both are valid; the id has no unacknowledged events (synchronous mode acked
        // each).
        if unsafe { rdma_migrate_id(self.id, channel) } != 0 {
            return Err(failed("moving an RDMA id to its event channel"));
        }
        Ok(())
    }

    /// The peer's address.
    pub(crate) fn peer(&self) -> Option<SocketAddr> {
        // SAFETY: the id is valid; its route's destination address is a sockaddr of the family
        // its sa_family says, stored in a sockaddr_storage-sized union.
        unsafe {
            let sa = rdma_get_peer_addr(&*self.id) as *const libc::sockaddr;
            sockaddr_to_std(sa)
        }
    }

    pub(crate) fn post_receive(&mut self, slot: usize) -> io::Result<()> {
        let addr = self.recv_buf[slot * SLOT_BYTES..].as_mut_ptr();
        // SAFETY: `addr..addr+SLOT_BYTES` lies in the registered receive buffer, which outlives
        // the queue pair (Drop destroys the id before the buffers are freed).
        let rc = unsafe { rdma_post_recv(self.id, slot as *mut _, addr.cast(), SLOT_BYTES, self.recv_mr) };
        if rc != 0 {
            return Err(failed("posting an RDMA receive"));
        }
        Ok(())
    }

    /// The bytes received into `slot` (`len` of them, from its completion).
    pub(crate) fn received(&self, slot: usize, len: usize) -> &[u8] {
        &self.recv_buf[slot * SLOT_BYTES..slot * SLOT_BYTES + len.min(SLOT_BYTES)]
    }

    /// Copies `data` (at most [`SLOT_BYTES`]; empty: the end of the stream) into send slot
    /// `slot` and posts it as one SEND.
    pub(crate) fn post_send(&mut self, slot: usize, data: &[u8]) -> io::Result<()> {
        assert!(data.len() <= SLOT_BYTES, "an RDMA send carries at most {SLOT_BYTES} bytes");
        let start = slot * SLOT_BYTES;
        self.send_buf[start..start + data.len()].copy_from_slice(data);
        let addr = self.send_buf[start..].as_mut_ptr();
        // SAFETY: the slot lies in the registered send buffer, not written again until this
        // send's completion frees the slot; the buffer outlives the queue pair.
        let rc = unsafe { rdma_post_send(self.id, slot as *mut _, addr.cast(), data.len(), self.send_mr, 0) };
        if rc != 0 {
            return Err(failed("posting an RDMA send"));
        }
        Ok(())
    }

    /// Up to `out.capacity()` completions of the send (`send`) or receive queue, without
    /// waiting. A failed completion is an error: the queue pair is in the error state.
    pub(crate) fn poll(&mut self, send: bool, out: &mut Vec<Completion>) -> io::Result<()> {
        // SAFETY: the id is valid; its CQs were made by rdma_create_ep.
        let cq = unsafe {
            if send {
                (*self.id).send_cq
            } else {
                (*self.id).recv_cq
            }
        };
        // SAFETY: all zeroes is a valid ibv_wc to be overwritten.
        let mut wcs: [ibv_wc; SLOTS] = unsafe { std::mem::zeroed() };
        // SAFETY: `wcs` has room for SLOTS entries.
        let n = unsafe { ibv_poll_cq(cq, SLOTS as c_int, wcs.as_mut_ptr()) };
        if n < 0 {
            return Err(failed("polling an RDMA completion queue"));
        }
        for wc in &wcs[..n as usize] {
            if wc.status != ibv_wc_status::IBV_WC_SUCCESS {
                // SAFETY: ibv_wc_status_str returns a static string for any status.
                let why = unsafe { CStr::from_ptr(ibv_wc_status_str(wc.status)) }.to_string_lossy();
                let dir =
                    if send { "send-queue work (a SEND, window bind or invalidation, or READ)" } else { "receive" };
                return Err(io::Error::new(io::ErrorKind::ConnectionReset, format!("RDMA {dir} failed: {why}")));
            }
            out.push(Completion { slot: wc.wr_id as usize, bytes: wc.byte_len as usize });
        }
        Ok(())
    }

    /// Why the queue pair failed, given the receive queue's error `e`: the send queue's first
    /// failure when it has one (a READ through a stale key, say, whose failure flushes the
    /// receives too), else `e`.
    pub(crate) fn cause(&mut self, e: io::Error) -> io::Error {
        let mut done = Vec::with_capacity(SLOTS);
        self.poll(true, &mut done).err().unwrap_or(e)
    }

    /// Whether the connection ended (the peer disconnected or its process died), without
    /// waiting.
    pub(crate) fn disconnected(&mut self) -> bool {
        let mut event: *mut rdma_cm_event = ptr::null_mut();
        // SAFETY: the channel is non-blocking; `event` is an out-pointer acknowledged below.
        if unsafe { rdma_get_cm_event(self.events, &mut event) } != 0 {
            return false;
        }
        // SAFETY: a returned event is valid until acknowledged.
        let kind = unsafe { (*event).event };
        // SAFETY: acknowledged once.
        unsafe { rdma_ack_cm_event(event) };
        matches!(
            kind,
            rdma_cm_event_type::RDMA_CM_EVENT_DISCONNECTED
                | rdma_cm_event_type::RDMA_CM_EVENT_DEVICE_REMOVAL
                | rdma_cm_event_type::RDMA_CM_EVENT_TIMEWAIT_EXIT
        )
    }
}

impl Endpoint {
    /// Whether this endpoint can lend (a server's, with its region registered).
    pub(crate) fn can_lend(&self) -> bool {
        self.region.is_some()
    }

    /// Windows allocated so far.
    pub(crate) fn windows(&self) -> usize {
        self.windows.len()
    }

    /// Allocates one more memory window (type 2: bound and invalidated through this queue pair
    /// only), answering its index.
    pub(crate) fn alloc_window(&mut self) -> io::Result<usize> {
        assert!(self.windows.len() < MAX_WINDOWS, "at most {MAX_WINDOWS} windows per connection");
        // SAFETY: the id's queue pair and its pd are valid; the window is deallocated in Drop.
        let mw = unsafe { ibv_alloc_mw((*(*self.id).qp).pd, ibv_mw_type::IBV_MW_TYPE_2) };
        match mw {
            Some(mw) if !mw.is_null() => {
                self.windows.push(mw);
                Ok(self.windows.len() - 1)
            }
            _ => Err(failed("allocating an RDMA memory window")),
        }
    }

    /// The key window `index` answers to now (its last bind's).
    pub(crate) fn window_rkey(&self, index: usize) -> u32 {
        // SAFETY: the window is valid until Drop.
        unsafe { (*self.windows[index]).rkey }
    }

    /// Posts a bind of window `index` (unbound) over `len` bytes at `addr` in the lendable region,
    /// remote read only, under a new key (the old one's low byte moved on, so a key handed out
    /// before names nothing): answers that key, valid once the bind's completion (`wr_id`)
    /// arrives. `Err` if `addr..addr+len` is not in the region.
    pub(crate) fn post_bind(&mut self, wr_id: u64, index: usize, addr: u64, len: usize) -> io::Result<u32> {
        let region = self.region.as_ref().ok_or_else(|| io::Error::other("this connection lends nothing"))?;
        let (start, end) = (region.base as u64, region.base as u64 + region.len as u64);
        if len == 0 || addr < start || addr.saturating_add(len as u64) > end {
            let why = format!("{len} bytes at {addr:#x} are not inside the lendable region {start:#x}..{end:#x}");
            return Err(io::Error::new(io::ErrorKind::InvalidInput, why));
        }
        let mw = self.windows[index];
        // SAFETY: the window is valid; ibv_inc_rkey only computes.
        let rkey = unsafe { ibv_inc_rkey((*mw).rkey) };
        // SAFETY: all zeroes is a valid ibv_send_wr to fill in.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.opcode = ibv_wr_opcode::IBV_WR_BIND_MW;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.bind_mw_tso_union.bind_mw = bind_mw_t {
            mw,
            rkey,
            bind_info: ibv_mw_bind_info {
                mr: region.mr,
                addr,
                length: len as u64,
                mw_access_flags: ibv_access_flags::IBV_ACCESS_REMOTE_READ.0,
            },
        };
        self.post(&mut wr, "binding an RDMA memory window")?;
        Ok(rkey)
    }

    /// Records that window `index`'s bind (under `rkey`) completed: the key it answers to now.
    pub(crate) fn bound(&mut self, index: usize, rkey: u32) {
        // The provider names a window by its current key in the next bind and invalidate; for a
        // type-2 window set by ibv_post_send that is this program's to keep.
        // SAFETY: the window is valid until Drop; only this thread touches it.
        unsafe { (*self.windows[index]).rkey = rkey };
    }

    /// Posts the invalidation of window `index` (bound under its current key): once its
    /// completion arrives no READ through that key succeeds.
    pub(crate) fn post_invalidate(&mut self, wr_id: u64, index: usize) -> io::Result<()> {
        // SAFETY: all zeroes is a valid ibv_send_wr to fill in.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.opcode = ibv_wr_opcode::IBV_WR_LOCAL_INV;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.imm_data_invalidated_rkey_union.invalidated_rkey = self.window_rkey(index);
        self.post(&mut wr, "invalidating an RDMA memory window")
    }

    /// Posts a READ of `len` bytes (at most [`READ_SLOT_BYTES`]) of the peer's window `rkey` at
    /// `remote` into read slot `slot`.
    pub(crate) fn post_read(&mut self, wr_id: u64, slot: usize, remote: u64, rkey: u32, len: usize) -> io::Result<()> {
        assert!(slot < READ_SLOTS && len <= READ_SLOT_BYTES, "a READ fits one read slot");
        if self.read_mr.is_null() {
            let mut buf = vec![0u8; READ_SLOTS * READ_SLOT_BYTES].into_boxed_slice();
            // SAFETY: the buffer is owned by the endpoint (moved in below, its heap address
            // unchanged), deregistered in Drop before it is freed.
            let mr = unsafe { rdma_reg_msgs(self.id, buf.as_mut_ptr().cast(), buf.len()) };
            if mr.is_null() {
                return Err(failed("registering the RDMA READ buffer"));
            }
            (self.read_buf, self.read_mr) = (buf, mr);
        }
        let local = self.read_buf[slot * READ_SLOT_BYTES..].as_mut_ptr();
        // SAFETY: the registration is valid until Drop.
        let lkey = unsafe { (*self.read_mr).lkey };
        let mut sge = ibv_sge { addr: local as u64, length: len as u32, lkey };
        // SAFETY: all zeroes is a valid ibv_send_wr to fill in.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_READ;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.wr.rdma = rdma_t { remote_addr: remote, rkey };
        self.post(&mut wr, "posting an RDMA READ")
    }

    /// What read slot `slot` holds (`len` bytes of its last READ).
    pub(crate) fn read_slot(&self, slot: usize, len: usize) -> &[u8] {
        &self.read_buf[slot * READ_SLOT_BYTES..slot * READ_SLOT_BYTES + len.min(READ_SLOT_BYTES)]
    }

    fn post(&mut self, wr: &mut ibv_send_wr, what: &str) -> io::Result<()> {
        let mut bad: *mut ibv_send_wr = ptr::null_mut();
        // SAFETY: the queue pair is valid; `wr` and what it points to (a scatter entry on the
        // caller's stack, copied by the provider at post) outlive the call.
        let rc = unsafe { ibv_post_send((*self.id).qp, wr, &mut bad) };
        if rc != 0 {
            let e = io::Error::from_raw_os_error(rc);
            return Err(io::Error::new(e.kind(), format!("{what}: {e}")));
        }
        Ok(())
    }
}

/// A storage server's lendable memory (its DRAM arena), registered on each protection domain
/// its RDMA connections use, once: with no access but the right to bind memory windows, so a
/// peer reaches only the bytes a window lends, and only through the connection that bound it.
pub(crate) struct Lendable {
    base: usize,
    len: usize,
    regions: parking_lot::Mutex<Vec<Arc<Region>>>,
}

impl Lendable {
    pub(crate) fn new(base: usize, len: usize) -> Lendable {
        Lendable { base, len, regions: parking_lot::Mutex::new(Vec::new()) }
    }

    /// The region registered on `pd`, registering it on the first call for that `pd`.
    fn region_on(&self, pd: *mut ibv_pd) -> io::Result<Arc<Region>> {
        let mut regions = self.regions.lock();
        if let Some(region) = regions.iter().find(|r| r.pd == pd) {
            return Ok(region.clone());
        }
        let access = ibv_access_flags::IBV_ACCESS_MW_BIND.0 as c_int;
        // SAFETY: base..base+len is the storage server's arena, mapped for the whole life of the
        // process (the store holds it), so the registration never outlives the memory.
        let mr = unsafe { ibv_reg_mr(pd, self.base as *mut _, self.len, access) };
        if mr.is_null() {
            return Err(failed(&format!("registering the {}-byte DRAM arena for memory windows", self.len)));
        }
        let region = Arc::new(Region { pd, mr, base: self.base, len: self.len });
        regions.push(region.clone());
        Ok(region)
    }
}

/// One registration of the lendable memory. Kept (by the listener and each of its endpoints)
/// until the last window bound over it is gone.
pub(crate) struct Region {
    pd: *mut ibv_pd,
    mr: *mut ibv_mr,
    base: usize,
    len: usize,
}

// SAFETY: the registration is only read after it is made; ibv_dereg_mr runs once, in Drop.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: registered once in Lendable::region_on, deregistered once here, after every
        // endpoint holding it (and so every window bound over it) is gone.
        unsafe { ibv_dereg_mr(self.mr) };
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        // SAFETY: each handle is released once, the queue pair (with the id) before the memory
        // registered for it, the id before its event channel. A null handle was never made.
        unsafe {
            rdma_disconnect(self.id);
            // Deallocating a window invalidates it: no peer reads through it from here on.
            for &mw in &self.windows {
                ibv_dealloc_mw(mw);
            }
            if !self.read_mr.is_null() {
                rdma_dereg_mr(self.read_mr);
            }
            if !self.send_mr.is_null() {
                rdma_dereg_mr(self.send_mr);
            }
            if !self.recv_mr.is_null() {
                rdma_dereg_mr(self.recv_mr);
            }
            rdma_destroy_ep(self.id);
            if !self.events.is_null() {
                rdma_destroy_event_channel(self.events);
            }
        }
    }
}

/// A C socket address as a std one (IPv4 and IPv6 only).
///
/// # Safety
/// `sa` must point to a socket address as large as its family says.
unsafe fn sockaddr_to_std(sa: *const libc::sockaddr) -> Option<SocketAddr> {
    if sa.is_null() {
        return None;
    }
    // SAFETY: the caller promises a valid address of the size its family implies.
    unsafe {
        match c_int::from((*sa).sa_family) {
            libc::AF_INET => {
                let v4 = &*(sa as *const libc::sockaddr_in);
                let ip = Ipv4Addr::from(u32::from_be(v4.sin_addr.s_addr));
                Some(SocketAddr::V4(SocketAddrV4::new(ip, u16::from_be(v4.sin_port))))
            }
            libc::AF_INET6 => {
                let v6 = &*(sa as *const libc::sockaddr_in6);
                let ip = Ipv6Addr::from(v6.sin6_addr.s6_addr);
                Some(SocketAddr::V6(SocketAddrV6::new(ip, u16::from_be(v6.sin6_port), 0, 0)))
            }
            _ => None,
        }
    }
}
