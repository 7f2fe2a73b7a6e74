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

use rdma_sys::*;

/// Send and receive slots per connection (each way): the queue depths, and with [`SLOT_BYTES`]
/// the registered memory of one connection (2 x 16 x 64 KiB = 2 MiB).
pub(crate) const SLOTS: usize = 16;
/// Bytes one SEND carries at most; a block frame of 1 MiB goes as 16 of them.
pub(crate) const SLOT_BYTES: usize = 64 << 10;

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
/// scatter entry per request, every send signalled (its slot is free again on completion).
fn qp_attr() -> ibv_qp_init_attr {
    // SAFETY: ibv_qp_init_attr is a plain C struct for which all zeroes is valid (null CQs ask
    // rdma_create_ep to make them).
    let mut attr: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
    attr.cap.max_send_wr = SLOTS as u32;
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
    pub(crate) fn accept(mut self) -> io::Result<Endpoint> {
        let id = std::mem::replace(&mut self.id, ptr::null_mut());
        let mut endpoint = Endpoint::new(id)?;
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

/// One completion taken from a completion queue.
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
                let dir = if send { "send" } else { "receive" };
                return Err(io::Error::new(io::ErrorKind::ConnectionReset, format!("RDMA {dir} failed: {why}")));
            }
            out.push(Completion { slot: wc.wr_id as usize, bytes: wc.byte_len as usize });
        }
        Ok(())
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

impl Drop for Endpoint {
    fn drop(&mut self) {
        // SAFETY: each handle is released once, the queue pair (with the id) before the memory
        // registered for it, the id before its event channel. A null handle was never made.
        unsafe {
            rdma_disconnect(self.id);
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
