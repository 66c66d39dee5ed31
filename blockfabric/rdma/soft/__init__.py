"""The soft provider: a faithful userspace RDMA NIC over framed TCP.

It behaves like an RC queue pair on an HCA (what the interface in ``rdma/base.py`` promises)
so that code above it cannot tell it from the verbs provider: memory must be registered;
every remote access is checked against rkey, bounds and access flags; payloads move between
the socket and registered memory with no intermediate copy; completions carry the real
verbs statuses; an error moves the QP to ERR and flushes.

Wire (one TCP connection per QP, both directions; little-endian; version 3)
---------------------------------------------------------------------------
Every frame starts with a 32-byte header (``wire.HEADER``)::

    0  magic   u8   0xBF
    1  version u8   3 (a peer speaking another version is refused, see below)
    2  type    u8   wire.Frame
    3  flags   u8   bit 0 WITH_IMM, bit 1 WITH_INV, bit 2 ACK (the ack field is valid),
                    bit 3 SHM (same-host: the data moved through shared memory),
                    bit 4 ACK_REQ (ACK frames: acknowledge now, see below)
    4  psn     u32  request sequence number (per direction, from 0, wraps)
    8  length  u32  payload bytes that follow; READ_REQ: bytes asked for (nothing follows)
    12 key     u32  WRITE/READ_REQ: rkey; NAK: the WcStatus the requester reports
    16 extra   u32  SEND/WRITE: imm_data or the rkey to invalidate; CONN_*: sender's qp_num
    20 ack     u32  with flag ACK (requests only): every request of the *other* direction up
                    to and including this PSN was executed (a cumulative ACK riding along)
    24 addr    u64  WRITE/READ_REQ: remote virtual address

CM: CONN_REQ (private data <= 56 B) -> CONN_REP or CONN_REJ (<= 196 B) -> CONN_RTU; DREQ
ends a connection.  Requests (SEND, WRITE, READ_REQ) each take the next PSN; the responder
executes them in PSN order and answers with READ_RESP (carries the data, and acknowledges
everything before it), NAK (with the status) or RNR_NAK, and acknowledges the rest
cumulatively: in the ack field of the first request it sends that peer in the same pass
(flag ACK), or, when it sends no request by the end of the pass that executed them, in an
explicit ACK frame (psn: the last request executed), so an owner that stops posting is
still acknowledged.  That frame goes out at the end of the pass when the pass sends the
peer anything else; when it would leave alone, a reactor's pass lets it wait up to
``device.ACK_DELAY`` (1 ms) for a request to ride on (a host's next command), as TCP's
delayed ACK; a disconnect sends one still owed before its DREQ.  A side that waits on
that ACK (see READ below) asks for it: an ACK frame (its own cumulative ACK, psn: the last
request it executed) flagged ACK_REQ, once per request of its own it waits behind; the peer
then sends the ACK it owes at the end of the pass that read the request, not later (IB's
AckReq).  A pass is one run of the
engine (and, under a reactor, its owners' work after it); everything a pass has for one
connection goes out in one sendmsg.

Same-host connections (``SoftProvider(shm=...)``, on unless BLOCKFABRIC_SOFT_SHM=0): a
listener also listens on the abstract unix socket ``\0blockfabric-soft/ADDRESS/PORT`` of its
network namespace, and a connect to an address of this namespace uses it when it exists.
The frames are the same; in addition each side sends a SHARE frame (key: rkey, extra:
access bits, addr and length: the region) for every region of its PD that is a sealed
memfd (``pd.shared_slab``) registered for remote access, the memfd travelling with the
frame's bytes or ahead of them (SCM_RIGHTS), and FORGET (key) when such a region closes.
A requester whose peer shared the region a WRITE or READ names (and that fits it) moves the
data with a copy: a WRITE is copied at its post and goes out as its header with flag SHM
and no payload.  A READ is copied at its post too and sends nothing: it takes no PSN and
completes in order, at once when nothing is outstanding, else with the request before it
(and asks for that one's ACK, above).  No copy at a post overtakes a request whose data
moves later: behind an RDMA WRITE whose data went through the socket (a region not shared,
or posted while held behind an RNR NAK) and is not acknowledged yet, or behind a READ not
answered yet, a WRITE goes out with its data, as any, and a READ as a READ_REQ with flag
SHM, answered by a READ_RESP with flag SHM and no payload, the requester copying from the
region then.  So a READ never overtakes data the peer has yet to place, a WRITE never lands
before an older one, and no READ sees a WRITE posted after it (as a responder executes
them in order; two keys may name the same memory).  A copy of 32 KiB or
more first sends what the pass queued for that peer.  A target's answer to a read (an
RDMA WRITE of the data and the SEND of the response, posted together, or with
``QP.post_write_send``) sends only the SEND: the WRITE, copied at the post, takes no PSN
and, signaled, completes in order, once everything posted before it has (at once when
nothing is outstanding).  Unsignaled, it takes no send-queue entry at all: its data is in
place and it has no completion to give, nor a flush should the connection then fail (an
HCA flushes an unacknowledged WRITE, whose effect may not have happened; this one's has).
Everything else is unchanged: each
request that goes out takes its PSN, the responder checks the key, bounds and access on
the header as it would the payload (NAK REM_ACCESS_ERR), and that the region is one it
shared (REM_INV_REQ_ERR), and completions come from its ACKs in order.

Version 1 (until 2026-12; headers began b"BFRD", a 16-bit flags field and no ack field, and
every ACK was a frame of its own) is not spoken, nor is version 2 (2026-12-03 to 12-07: no
ACK_REQ, which such a peer would take for a violation); a version-2 peer is refused by
name, as any header of another version.  A listener answers a version-1 CONN_REQ
with a version-1 CONN_REJ (so an old host reports a rejection, not a reset) and logs the
first one at WARNING; an active side that gets a version-1 answer fails ``connect`` with an
RdmaError naming the version (a version-1 listener closes on a newer CONN_REQ without an
answer: that error says a peer of another version may be why).

Validation: the peer is not trusted
-----------------------------------
Every header is checked before any field is used (``wire.decode``, then the QP's state), on
both sides and in the CM exchange:

* type: one of ``wire.Frame``; CM frames only during set-up (CONN_RTU once, as the passive
  side's first frame), never on a connected QP;
* flags: only WITH_IMM or WITH_INV on SEND (not both), only WITH_IMM on WRITE, ACK on
  the three requests only, ACK_REQ on ACK frames only, none elsewhere;
* length: private data <= 56 B (CONN_REQ) or 196 B (CONN_REP, CONN_REJ); 0 for CONN_RTU,
  DREQ, ACK, NAK, RNR_NAK; at most MAX_MESSAGE (2 GiB) for the rest; a SEND no longer than
  its posted receive, a WRITE/READ_REQ inside the MR its rkey names (else the NAKs below);
  a READ_RESP exactly as long as its READ;
* fields a type does not use are zero: psn and key of CM frames; key of SEND, READ_RESP,
  ACK, RNR_NAK; extra unless a flag gives it a meaning (CONN_REQ/CONN_REP: a 24-bit QP
  number); ack unless flag ACK; addr of all but WRITE and READ_REQ;
* NAK key: a remote error status (REM_INV_REQ_ERR, REM_ACCESS_ERR, REM_OP_ERR);
* shared memory: SHARE, FORGET and flag SHM only on a same-host (unix socket) connection;
  a SHARE's descriptor must be a memfd sealed against shrinking (F_SEAL_SHRINK: no page of
  the mapping can go away, so no SIGBUS) and of ordinary pages (not hugetlbfs, where a hole
  its owner punches frees the pages and their reservation), at least as long as the region
  and mappable for writing, its key new; at most 16 descriptors may wait for their SHARE
  frames; regions past 64 or past 1 GiB mapped per connection are declined (requests to
  them use the socket);
* PSNs: a request must carry the next PSN (another only while go-back-N after an RNR NAK,
  when it is dropped, or once the QP is in ERR); an ACK, NAK, RNR_NAK or READ_RESP must name
  a request that was sent (ACK, a request's ack field, READ_RESP: sent *whole*, every byte
  taken by the kernel; an older cumulative ACK than one already seen completes nothing;
  NAK, RNR_NAK: its header sent) and may not pass a READ still unanswered; a READ_RESP
  answers a READ, an RNR_NAK a request that consumes a receive.

A violation is that connection's end (as an HCA moves the QP to ERR on a fatal error): the
socket closes, both queues flush, the CM id gets DISCONNECTED, and one WARNING line names the
peer and the violation.  Nothing of it reaches another connection: the engine catches any
exception raised while handling one connection (a bug included) and ends that connection
only.  A send WR completes only when the peer answers for bytes it has had in full, and an
error that completes WRs while frames are still queued for the socket first closes it, so the
provider never sends (nor, for receives and READs, places) memory its owner got back.
Frames the peer leaves unread are bounded per connection by ``QP.max_unsent`` (bytes, each
queued buffer counted 128 B more; default 1 GiB, the target sets it per queue from
``limits.max_unsent_bytes``): past it the connection is cut, logged once.

Semantics, and where a choice was made (as an IB HCA does it unless said otherwise)
-------------------------------------------------------------------------------------
* Send completions come only from the peer's ACK/READ_RESP, i.e. once the data is placed.
  Unsignaled WRs complete silently unless they fail; flushes report every WR.
* RNR: a SEND (or WRITE_WITH_IMM) meeting an empty receive queue is dropped and answered
  with RNR_NAK; the responder then drops every request until the NAKed PSN comes again
  (go-back-N).  The requester waits (1 ms, doubling to 50 ms: a soft choice, IB uses a fixed
  min_rnr_timer) and resends from that PSN; after ``rnr_retry_count`` retries (7 = forever)
  the WR completes RNR_RETRY_EXC_ERR and the QP goes to ERR.
* A bad rkey, range, PD or missing REMOTE_READ/REMOTE_WRITE: the responder NAKs before
  touching memory (the payload is read into a scratch buffer and dropped), the requester's
  WR completes REM_ACCESS_ERR, and both QPs go to ERR (the responder's receives are flushed).
  A SEND longer than the receive buffer: LOC_LEN_ERR at the receiver, REM_INV_REQ_ERR at the
  sender, both to ERR.  A receive whose SGEs are invalid: LOC_PROT_ERR at the receiver,
  REM_OP_ERR at the sender.
* Local SGE errors (unknown lkey, other PD, out of bounds, READ into memory without
  LOCAL_WRITE): post succeeds; the WR completes LOC_PROT_ERR when it reaches the head of the
  send queue (earlier WRs complete normally), then the QP goes to ERR.
* Queue limits are checked at post time for the whole chain: more WRs than the free slots
  -> RdmaError(ENOMEM), too many SGEs, an unknown opcode or inline data past
  ``max_inline_data`` -> EINVAL; nothing is posted then
  (verbs would post the WRs before the bad one: all-or-nothing is simpler to reason about).
  A send slot is free once its WR is acknowledged.
* SEND_WITH_INV delivers ``invalidated_rkey`` and WcFlags.WITH_INV.  MRs from reg_mr are
  long-lived, and verbs cannot invalidate those (only MWs and fast-registered MRs), so the
  named rkey is reported and stays valid; there are no fast-registration WRs here.
* A closed or reset socket, a DREQ, or TCP_USER_TIMEOUT/keep-alive expiry: the QP goes to
  ERR (flushing both queues) and the CM id gets DISCONNECTED.  A peer that stops answering
  while the socket lives fails the oldest WR with RETRY_EXC_ERR after
  ``ack_timeout * (retry_count + 1)`` (2 s per retry by default).
* Posting to a QP in ERR completes the WRs with WR_FLUSH_ERR.
* SendFlags.FENCE: the WR, and every WR posted after it, waits until the RDMA READs
  posted before it have their data (a READ copied from a shared region at its post has
  it at once); then they go out in order.  An RNR replay stops at it likewise.

Progress: ``SoftProvider(progress="poll")`` (default) runs the engine on the thread that owns
the queues, with no thread hand-off (measured 1.4x QD1 and 2.3x QD16 IOPS at library level,
see docs/performance.md): a reactor (``Reactor.add_cq``) registers the device once and each
wake-up is one pass, the engine once and then only the owners of CQs that got completions
(see :mod:`blockfabric.rdma.soft.device`); a CQ no reactor serves runs the engine inside
``CQ.poll()``, and its fd is the device's epoll fd.  ``progress="thread"`` runs the engine
in a daemon thread and CQ fds are eventfds, for owners that do not poll.  Within a pass
(the engine's, or a reactor's ``run_once``) a thread's frames for one connection leave
together in one sendmsg at its end; other posts transmit from the caller's thread at once.
"""

from blockfabric.rdma.soft.cm import SoftCMId, SoftListener, SoftProvider
from blockfabric.rdma.soft.cq import SoftCQ
from blockfabric.rdma.soft.device import SoftContext
from blockfabric.rdma.soft.memory import SoftMR, SoftPD
from blockfabric.rdma.soft.qp import SoftQP

__all__ = ["SoftProvider", "SoftContext", "SoftPD", "SoftMR", "SoftCQ", "SoftQP", "SoftCMId",
           "SoftListener"]
