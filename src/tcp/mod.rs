//! The network transport: leader and workers in separate processes, one TCP connection per worker.
//!
//! * `frame` — the [wire protocol](self#wire-protocol)'s header and payloads, reading and
//!   writing frames (crate-private; [`PROTOCOL_VERSION`] is public);
//! * `leader` — [`TcpLeader`]: admission, the connection table, the accept/reader/writer tasks;
//! * `worker` — [`TcpWorker`]: connecting with retries, the reader thread;
//! * [`rendezvous`] — finding the leader with no address configured: [`RendezvousLeader`]
//!   (an ephemeral loopback port and a fresh token, published in a private per-user directory
//!   under a name derived from an id both halves know) and [`LazyTcpWorker`] (finds its leader,
//!   by address or rendezvous file, and connects on first use).
//!
//! Their settings (the leader's address, the auth token, the heartbeat interval and timeout,
//! `allow_insecure`) are [`TcpConfig`], part of [`Config`].
//!
//! [`TcpLeader`] implements [`LeaderTransport`] and [`TcpWorker`] implements [`WorkerTransport`],
//! so the start-up barrier ([`barrier`](crate::connector::barrier)) and the leader's completion
//! handling run over the network unchanged.
//!
//! # Wire protocol
//!
//! Every message in either direction is one *frame*: a 12-byte header followed by a payload (JSON,
//! except COMPLETIONS, which is binary). The version this build speaks is [`PROTOCOL_VERSION`]
//! (its documentation lists what each version added); versions do not mix.
//!
//! | offset | size | field    | value |
//! |--------|------|----------|-------|
//! | 0      | 4    | magic    | the ASCII bytes `KVBM` (`4B 56 42 4D`) |
//! | 4      | 2    | version  | [`PROTOCOL_VERSION`], `u16` big-endian |
//! | 6      | 1    | kind     | `1` HELLO, `2` WELCOME, `3` REFUSED, `4` MSG, `5` HEARTBEAT, `6` COMPLETIONS |
//! | 7      | 1    | reserved | senders write `0`; receivers ignore it |
//! | 8      | 4    | length   | payload length in bytes, `u32` big-endian |
//! | 12     | n    | payload  | exactly `length` bytes: UTF-8 JSON, or binary for COMPLETIONS |
//!
//! Payloads by kind:
//!
//! * **HELLO** (worker → leader, first frame only):
//!   `{"rank":0,"world_size":2,"token":"secret"}` (`token` is `null` when the worker has none).
//!   At most 64 KiB.
//! * **WELCOME** (leader → worker, answers HELLO):
//!   `{"rank":0,"world_size":2,"heartbeat_ms":1000,"heartbeat_timeout_ms":10000}` (the leader's
//!   heartbeat settings, which the worker follows; see [Heartbeats](self#heartbeats)).
//! * **REFUSED** (leader → worker, answers HELLO, then the leader closes):
//!   `{"reason":"authentication token mismatch"}`.
//! * **MSG** (both directions, after WELCOME): from a worker a
//!   [`WorkerMessage`], from the leader a [`LeaderMessage`], in serde's externally tagged JSON form:
//!   `"Ready"`, `{"Failed":"why"}`,
//!   `{"Hello":{"rank":0,"world_size":2,"bytes_per_block":4096,"num_device_blocks":32,"dims":{...}}}`,
//!   `{"Completed":[{"op":7,"failed_dst_blocks":[],"error":null}]}`,
//!   `{"StoreStats":{"available":true,"errors":0,"timeouts":2,"reconnects":0,"invalid":1}}` (the
//!   worker's remote store's counters, when they changed; version 4),
//!   `{"DiskIndex":[[3,123456789],…]}` (barrier step 2, before `"Ready"`: `(block, key)` pairs a
//!   persisted disk tier holds, at most 65,536 a message; version 5),
//!   `"Goodbye"` (the worker is closing on purpose),
//!   `{"Allocate":{"num_host_blocks":8,"num_disk_blocks":0,"num_device_blocks":32}}`,
//!   `{"Refused":"why"}`, `"Ready"` from the leader (barrier step 3: it is ready; version 6),
//!   `{"Finish":{"after_iteration":12,"metadata":[75,86,77,68,…]}}` (the metadata's bytes: a
//!   finished request's last stores and hold, sent when the engine may build no more metadata;
//!   see `Leader::request_finished_now`), `"Goodbye"` from the leader (it is closing on purpose,
//!   the last frame it sends; version 6). At most 16 MiB.
//!   [`WorkerMessage::Disconnected`] is generated locally and never sent; a leader that receives
//!   it from a peer closes that connection.
//! * **HEARTBEAT** (both directions, after WELCOME): empty payload (a receiver ignores any).
//! * **COMPLETIONS** (worker → leader, after WELCOME): a batch of completions, delivered to the
//!   leader as one [`WorkerMessage`]`::Completed`. Binary, all integers big-endian: `count: u32`,
//!   then `count` entries of `op: u64`, `flags: u8` (bit 0: an error text follows; bit 1:
//!   *continued*, more failed blocks of this operation follow in the next entry, possibly in the
//!   next frame; other bits 0), `n: u32`, `n` failed destination blocks (`u64` each), and, with
//!   bit 0, `len: u32` and `len` bytes of UTF-8. At most 16 MiB: a worker splits a larger batch
//!   over several frames, and an operation whose failed blocks alone exceed a frame over
//!   continued entries, which the leader merges (no failed block is dropped); error texts are
//!   cut to 4 KiB. A count or length larger than the bytes that remain, unknown flags, a
//!   continued operation followed by another one, or trailing bytes close the connection.
//!   Completions sent as a MSG (`{"Completed":[…]}`) are still accepted.
//!
//! A worker reports completions in batches: it queues them and sends what is queued once per
//! engine iteration (in `get_finished`, before the engine hears of them), and between iterations
//! when its last operation in flight finishes or after at most 5 ms — so one message per iteration
//! and rank rather than one per operation, and never later than the iteration a completion
//! finished in (see `connector::outbox`).
//!
//! A payload is at most the limit of its kind; a header claiming more closes the connection
//! before any payload byte is read, and a payload's buffer grows in 64 KiB steps as its bytes
//! arrive, so a claimed length is never allocated up front.
//!
//! Unknown JSON fields are ignored (a later version may add fields without a version bump).
//!
//! # Handshake
//!
//! ```text
//!  worker                                   leader
//!    |-- connect (retried until deadline) --->|
//!    |-- HELLO {rank, world_size, token} ---->|   within HANDSHAKE_TIMEOUT (5 s) of connecting
//!    |<------------ WELCOME {rank, world} ----|   admitted: MSG frames both ways from now on
//!    |<------------ REFUSED {reason} ---------|   or refused: the leader closes the connection
//! ```
//!
//! The leader refuses a HELLO (answers REFUSED with the reason, logs it with the peer address and
//! rank, and closes that connection) when, checked in this order:
//!
//! 1. it has an auth token (`KVBM_AUTH_TOKEN`, [`TcpConfig::auth_token`]) and the HELLO carries none or another one (the
//!    comparison is in constant time, over SHA-256 digests of both tokens);
//! 2. `rank >= world_size`, or `world_size` differs from the leader's;
//! 3. the session has started (see below): "rank N already joined this session; restart the
//!    leader to rejoin" (or, for a rank that never joined, "the session already started without
//!    rank N; restart the leader to add it");
//! 4. that rank is connected already: "rank N is already connected (from ADDR)".
//!
//! It also refuses, with a REFUSED frame, a client that speaks the protocol (right magic) but
//! sends another protocol version ("protocol version 2 is not supported (this side speaks
//! version N)", N being [`PROTOCOL_VERSION`]), another frame kind than HELLO first, an oversized or
//! undecodable HELLO, and a client that sends no complete HELLO within the handshake timeout.
//! Bytes that do not start with the magic (an HTTP request, random data) get no answer: the
//! connection is just closed. At most 64 handshakes are pending at once; more connections are
//! closed at once.
//!
//! A worker whose leader answers in another protocol version gets an
//! [`ErrorKind::Unsupported`] error at once, naming both versions ("the kvbm leader at ADDR
//! speaks wire protocol version 2 and rank 0 speaks version N: run the same kvbm-connector
//! release on the leader and every worker").
//!
//! # Heartbeats
//!
//! A stopped (SIGSTOP), frozen or unreachable peer keeps its TCP connection open, so after
//! WELCOME each side sends a HEARTBEAT whenever it has written nothing for the heartbeat interval
//! ([`TcpConfig::heartbeat_secs`], `KVBM_HEARTBEAT_SECS`, default 1 s) and counts **no frame at
//! all** for the heartbeat timeout ([`TcpConfig::heartbeat_timeout_secs`],
//! `KVBM_HEARTBEAT_TIMEOUT_SECS`, default 10 s, at least twice the interval) as a lost peer: the
//! leader closes that connection and delivers [`WorkerMessage::Disconnected`] for the rank,
//! exactly as for a killed worker; the worker closes its connection, and its calls fail with
//! [`ErrorKind::Cancelled`]. The leader's values rule: it announces them in WELCOME. Heartbeats
//! are sent by the leader's per-connection writer task and by a worker thread of their own
//! (`kvbm-tcp-heartbeat-N`), outside the engine's locks and Python's GIL, so an idle or busy
//! worker is never declared lost; only a peer that stops running (or whose network does) is.
//! A caller that finds a rank dead by a deadline of its own (e.g. `kvbm replay`'s per-call
//! deadline) hands it to the same path with [`TcpLeader::disconnect`].
//!
//! # After the handshake
//!
//! A frame with a wrong magic or version, an unknown kind, a kind other than MSG, COMPLETIONS or
//! HEARTBEAT, a
//! length above
//! 16 MiB, or a payload that does not decode closes *that* connection with a logged reason
//! (`tracing::warn!` with the peer address and rank); other connections are not affected. When an
//! admitted worker's connection ends for any reason (end of stream, I/O error, a frame as above),
//! the leader logs it with the rank and delivers [`WorkerMessage::Disconnected`] for that rank
//! through [`LeaderTransport::recv_timeout`] / [`LeaderTransport::try_recv`], after every message
//! that connection delivered. [`LeaderTransport::send`] to a rank that is not connected is an
//! [`ErrorKind::Cancelled`] error naming the rank. On the worker side, once the leader connection
//! is gone, [`WorkerTransport::recv_timeout`] (after the messages already received) and
//! [`WorkerTransport::send`] are [`ErrorKind::Cancelled`] errors saying why.
//!
//! An orderly close is told from a loss on both sides. A worker that closes ([`TcpWorker::close`],
//! or dropping it) first sends `"Goodbye"`: the leader logs the rank's departure at INFO and its
//! `Disconnected` reason is [`GOODBYE`]. A leader that is dropped first queues `"Goodbye"` to every
//! connected worker, after what it queued before: the worker delivers it (the connector's worker
//! then knows its leader left), logs the departure at INFO, and its calls' errors name
//! [`LEADER_GOODBYE`] as the reason ([`TcpWorker::close_reason`]). A connection that ends without
//! a goodbye (a killed process, a reset, the heartbeat timeout) is a loss, logged as a WARNING
//! on the side that sees it.
//!
//! # Rejoining: refused once the session started
//!
//! The session starts when every rank has confirmed its allocation ([`WorkerMessage::Ready`] from
//! all `world_size` ranks over their current connections, i.e. when the barrier completes), or
//! when the leader calls [`TcpLeader::mark_session_started`], whichever comes first. Before that, a
//! rank whose connection dropped may connect again; its old connection's
//! [`WorkerMessage::Disconnected`] is queued before anything the new connection sends, so the
//! barrier can forget the old report and take the new one. After it, a returning rank is refused with "rank N already joined this session;
//! restart the leader to rejoin": a restarted worker lost the contents of its host and disk
//! tiers, while the leader's block pools still record those blocks as stored on every rank, so
//! serving a prefix hit from them would load garbage on that rank's shard. Restarting the leader
//! restarts the accounting from empty.
//!
//! # Deployment and threads
//!
//! The leader binds [`TcpConfig::leader_addr`] (`KVBM_LEADER_ADDR` or `tcp.leader_addr`, default
//! `127.0.0.1:5557`, loopback only); a multi-node deployment sets it to an address the workers
//! can reach, and must then set `KVBM_AUTH_TOKEN` on leader and workers: the leader **refuses**
//! to bind a non-loopback address without a token (an [`ErrorKind::InvalidConfig`] error naming
//! the address, `KVBM_AUTH_TOKEN` and `KVBM_ALLOW_INSECURE`), since anyone who reaches the port
//! could join as a worker, unless [`TcpConfig::allow_insecure`] (`KVBM_ALLOW_INSECURE=1`) says
//! so explicitly (it then warns). [`TcpLeader::bind`] reads these settings from the environment;
//! [`TcpLeader::bind_with`] takes them. The token is an authenticator only: traffic is not
//! encrypted. With no address configured, the
//! Python package's vLLM connector uses the [`rendezvous`] instead: an ephemeral loopback port,
//! found through a private file, with a per-leader token.
//!
//! [`TcpLeader`] owns a tokio runtime with one worker thread (`kvbm-tcp-leader`): an accept loop,
//! and per connection a reader task (feeding one `std::sync::mpsc` channel read by
//! `recv_timeout`/`try_recv`) and a writer task (fed by a per-rank channel; `send` never blocks).
//! Dropping it queues a `"Goodbye"` to every connected worker and gives the writers up to one
//! second to send what is queued (so a refusal's reason reaches the worker, and the goodbye
//! follows it), then stops the runtime and closes every connection; workers then see
//! [`ErrorKind::Cancelled`]. Dropping it inside another tokio runtime skips the flush. [`TcpWorker`] uses blocking
//! sockets: `send` writes the frame on the caller's thread, one reader thread
//! (`kvbm-tcp-worker-N`) feeds `recv_timeout`, and one heartbeat thread (`kvbm-tcp-heartbeat-N`)
//! beats; frames are written whole under one lock.
//!
//! [`Config`]: crate::config::Config
//! [`TcpConfig`]: crate::config::TcpConfig
//! [`TcpConfig::leader_addr`]: crate::config::TcpConfig::leader_addr
//! [`TcpConfig::auth_token`]: crate::config::TcpConfig::auth_token
//! [`TcpConfig::heartbeat_secs`]: crate::config::TcpConfig::heartbeat_secs
//! [`TcpConfig::heartbeat_timeout_secs`]: crate::config::TcpConfig::heartbeat_timeout_secs
//! [`TcpConfig::allow_insecure`]: crate::config::TcpConfig::allow_insecure
//! [`LeaderMessage`]: crate::connector::transport::LeaderMessage
//! [`WorkerMessage`]: crate::connector::transport::WorkerMessage
//! [`WorkerMessage::Disconnected`]: crate::connector::transport::WorkerMessage::Disconnected
//! [`WorkerMessage::Ready`]: crate::connector::transport::WorkerMessage::Ready
//! [`GOODBYE`]: crate::connector::transport::GOODBYE
//! [`LEADER_GOODBYE`]: crate::connector::transport::LEADER_GOODBYE
//! [`LeaderTransport`]: crate::connector::transport::LeaderTransport
//! [`LeaderTransport::recv_timeout`]: crate::connector::transport::LeaderTransport::recv_timeout
//! [`LeaderTransport::try_recv`]: crate::connector::transport::LeaderTransport::try_recv
//! [`LeaderTransport::send`]: crate::connector::transport::LeaderTransport::send
//! [`WorkerTransport`]: crate::connector::transport::WorkerTransport
//! [`WorkerTransport::recv_timeout`]: crate::connector::transport::WorkerTransport::recv_timeout
//! [`WorkerTransport::send`]: crate::connector::transport::WorkerTransport::send

mod frame;
mod leader;
pub mod rendezvous;
#[cfg(test)]
mod tests;
mod worker;

use crate::error::{Error, ErrorKind};

pub use frame::PROTOCOL_VERSION;
pub use leader::{Received, TcpLeader, HANDSHAKE_TIMEOUT};
pub use rendezvous::{LazyTcpWorker, LeaderTarget, RendezvousLeader};
pub use worker::TcpWorker;

/// The error of an operation on a connection that is gone.
fn cancelled(message: String) -> Error {
    Error::new(ErrorKind::Cancelled, message)
}
