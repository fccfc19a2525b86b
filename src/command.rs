//! The command channel: requests and replies as FlatBuffers envelopes ([`crate::wire`]) in
//! the two SPSC rings of a region ([`crate::ring`]).
//!
//! The client pushes a request into the client→engine ring and rings the engine's
//! doorbell; the engine, between steps (inside `wait_actions_with` or `poll_commands`),
//! pops it, answers built-ins itself (`Hello`, `GetSchema`, `Ping`, `Close`), hands `Reset`
//! and engine-defined methods to its [`CommandHandler`], and pushes the reply, with the
//! request's correlation id, into the engine→client ring. Unknown methods get an error
//! reply, never silence.

use std::time::Duration;

use crate::error::{Error, Peer, Result};
use crate::layout::{Layout, ShardInfo};
use crate::primitive::AtomicU32;
use crate::region::Region;
use crate::ring::{Ring, RingCtrl};
use crate::shard::ShardSlot;
use crate::sync;
use crate::tensor::Tensors;
use crate::wire::{self, code, Body, Envelope, Kind, Method};

/// What a handler answers to an engine-defined method.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reply {
    pub args: Vec<(String, String)>,
    pub payload: Vec<u8>,
}

impl Reply {
    pub fn args(args: Vec<(String, String)>) -> Self {
        Reply {
            args,
            payload: Vec::new(),
        }
    }
}

/// A handler's refusal, sent back to the client as an error reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandError {
    pub code: u16,
    pub message: String,
}

impl CommandError {
    pub fn bad_request(message: impl Into<String>) -> Self {
        CommandError {
            code: code::BAD_REQUEST,
            message: message.into(),
        }
    }
    pub fn unsupported(message: impl Into<String>) -> Self {
        CommandError {
            code: code::UNSUPPORTED,
            message: message.into(),
        }
    }
    pub fn unknown_method(method: &str, known: &[&str]) -> Self {
        CommandError {
            code: code::UNKNOWN_METHOD,
            message: if known.is_empty() {
                format!("unknown method '{method}': this engine defines no methods")
            } else {
                format!(
                    "unknown method '{method}' (this engine has: {})",
                    known.join(", ")
                )
            },
        }
    }
    pub fn engine(e: Error) -> Self {
        CommandError {
            code: code::ENGINE_ERROR,
            message: e.to_string(),
        }
    }
}

/// Parses the argument `key` of an engine-defined method.
pub fn arg<T: std::str::FromStr>(args: &[(String, String)], key: &str) -> Result<T, CommandError> {
    let (_, v) = args
        .iter()
        .find(|(k, _)| k == key)
        .ok_or_else(|| CommandError::bad_request(format!("missing argument '{key}'")))?;
    v.parse()
        .map_err(|_| CommandError::bad_request(format!("argument '{key}': cannot parse '{v}'")))
}

/// A `Reset` request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResetRequest {
    /// `None`: every env.
    pub env_ids: Option<Vec<u32>>,
    /// None, one (env k of the list gets `seed + k`), or one per env.
    pub seeds: Vec<u64>,
    pub options: Vec<(String, String)>,
}

impl ResetRequest {
    /// The request checked as `docs/protocol.md` §7.2 says, for an engine of `num_envs`
    /// envs (an id ≥ `num_envs`, then a seed count other than 0, 1 or one per listed
    /// env: `BAD_REQUEST`). Returns the envs to reset in list order (every env when none
    /// is listed; duplicates kept) and, when seeds were given, the seed of the k-th one's
    /// new stream: `seeds[0] + k` (wrapping) for one seed, `seeds[k]` for one per env
    /// (Gymnasium's vector-env convention). Every engine face (Rust envs, the C ABI's
    /// reset callback) plans resets with this one function.
    pub fn plan(&self, num_envs: u32) -> Result<(Vec<u32>, Option<Vec<u64>>), CommandError> {
        let ids = match &self.env_ids {
            Some(ids) => ids.clone(),
            None => (0..num_envs).collect(),
        };
        if let Some(&bad) = ids.iter().find(|&&i| i >= num_envs) {
            return Err(CommandError::bad_request(format!(
                "env id {bad} out of range (num_envs {num_envs})"
            )));
        }
        let seeds = match self.seeds[..] {
            [] => None,
            [s] => Some((0..ids.len() as u64).map(|k| s.wrapping_add(k)).collect()),
            ref many if many.len() == ids.len() => Some(many.to_vec()),
            ref many => {
                return Err(CommandError::bad_request(format!(
                    "{} seeds for {} envs: give none, one, or one per env",
                    many.len(),
                    ids.len()
                )))
            }
        };
        Ok((ids, seeds))
    }
}

/// What an engine does with `Reset` and with its own methods. Both default to refusing.
pub trait CommandHandler {
    /// Reset the requested envs and write their observations into the engine→client
    /// tensors; the client reads them once the reply arrives.
    fn reset(&mut self, _io: &mut Tensors<'_>, _req: &ResetRequest) -> Result<(), CommandError> {
        Err(CommandError::unsupported(
            "this engine does not handle Reset",
        ))
    }
    fn call(
        &mut self,
        _io: &mut Tensors<'_>,
        method: &str,
        _args: &[(String, String)],
        _payload: &[u8],
    ) -> Result<Reply, CommandError> {
        Err(CommandError::unknown_method(method, &[]))
    }
}

/// Answers the built-ins only.
pub struct BuiltinsOnly;
impl CommandHandler for BuiltinsOnly {}

/// The two rings of a region, as one side sees them.
pub(crate) struct Channel<'a> {
    pub c2e: Ring<'a>,
    pub e2c: Ring<'a>,
}

/// The rings of `shard` in `region` (an unsharded region's one shard: the control
/// block's), if the layout has rings.
pub(crate) fn channel<'a>(region: &'a Region, shard: &'a ShardInfo) -> Result<Option<Channel<'a>>> {
    let Some(rings) = shard.rings else {
        return Ok(None);
    };
    let control = ShardSlot::new(region, shard)?;
    let ring = |ctrl: RingCtrl<'a>, (offset, cap): (u64, u64), who: Peer| {
        // SAFETY: validation (or the builder, for the engine) checked that
        // `offset..offset + cap` lies inside the mapping, page-aligned, overlapping no
        // tensor and not the other ring; the mapping outlives `'a` (borrowed from
        // `region`), and ring data is only ever touched through rings.
        unsafe { Ring::new(ctrl, region.ptr().add(offset as usize), cap, who) }
    };
    Ok(Some(Channel {
        c2e: ring(control.c2e_ring(), rings.c2e, Peer::Client)?,
        e2c: ring(control.e2c_ring(), rings.e2c, Peer::Engine)?,
    }))
}

/// Rings the engines' doorbell `bell` after a command push. `flags`: the waiter flag of
/// every engine process that sleeps on it: the doorbell's own for an unsharded region,
/// each shard's for a sharded one (1.4), since a shard sleeps with a flag of its own and
/// one whose flag is not looked at is not woken (it would see the command only when its
/// sleep slice ran out, 10 ms later).
pub(crate) fn ring_doorbell<'a>(
    bell: &sync::Doorbell<'a>,
    flags: impl IntoIterator<Item = &'a AtomicU32>,
) {
    sync::post_all(bell, 0, flags);
}

/// How long the engine waits for room in the reply ring before giving up on a reply.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(5);

/// The engine's answer to one request.
pub(crate) fn answer(
    request: Envelope,
    layout: &Layout,
    metadata: &[(String, String)],
    frame: u64,
    io: &mut Tensors<'_>,
    handler: &mut dyn CommandHandler,
) -> Envelope {
    let mut reply = Envelope {
        id: request.id,
        kind: Kind::Reply,
        method: request.method.clone(),
        body: Body::None,
        args: Vec::new(),
        payload: Vec::new(),
        error: None,
    };
    if request.kind != Kind::Request {
        reply.error = Some((code::BAD_REQUEST, "the engine only takes requests".into()));
        return reply;
    }
    let result: Result<(), CommandError> =
        match (&request.method, request.body) {
            (Method::Hello, Body::Hello { .. }) => {
                reply.body = Body::Welcome {
                    protocol_major: crate::layout::VERSION_MAJOR,
                    protocol_minor: crate::layout::VERSION_MINOR,
                    engine_pid: layout.engine_pid,
                    engine_kind: layout.engine_kind.clone(),
                };
                Ok(())
            }
            (Method::GetSchema, _) => {
                reply.body = Body::Schema {
                    num_envs: layout.num_envs,
                    engine_kind: layout.engine_kind.clone(),
                    tensors: layout
                        .tensors
                        .iter()
                        .map(wire::TensorSchema::from_info)
                        .collect(),
                    metadata: metadata.to_vec(),
                };
                Ok(())
            }
            (Method::Ping, body) => {
                reply.body = Body::Pong(match body {
                    Body::Ping(payload) => payload,
                    _ => Vec::new(),
                });
                Ok(())
            }
            (Method::Close, _) => {
                reply.body = Body::Close;
                Ok(())
            }
            (Method::Reset, body) => {
                let req = match body {
                    Body::Reset {
                        env_ids,
                        seeds,
                        options,
                    } => ResetRequest {
                        env_ids,
                        seeds,
                        options,
                    },
                    _ => ResetRequest::default(), // no body: every env, no seeds
                };
                handler
                    .reset(io, &req)
                    .map(|()| reply.body = Body::ResetDone { frame })
            }
            (Method::Custom(name), _) => handler
                .call(io, name, &request.args, &request.payload)
                .map(|r| {
                    reply.args = r.args;
                    reply.payload = r.payload;
                }),
            (m, _) => Err(CommandError::bad_request(format!(
                "request {m:?} carries the wrong body"
            ))),
        };
    if let Err(e) = result {
        reply.error = Some((e.code, e.message));
    }
    reply
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn reset_plans_follow_the_protocol() {
        use crate::wire::code;
        let req = |env_ids: Option<Vec<u32>>, seeds: Vec<u64>| ResetRequest {
            env_ids,
            seeds,
            options: Vec::new(),
        };
        assert_eq!(req(None, vec![]).plan(3).unwrap(), (vec![0, 1, 2], None));
        assert_eq!(
            req(None, vec![u64::MAX]).plan(3).unwrap(),
            (vec![0, 1, 2], Some(vec![u64::MAX, 0, 1])),
            "one seed: seed + k, wrapping"
        );
        assert_eq!(
            req(Some(vec![2, 0, 2]), vec![7, 8, 9]).plan(3).unwrap(),
            (vec![2, 0, 2], Some(vec![7, 8, 9])),
            "one per listed env, duplicates kept in order"
        );
        assert_eq!(
            req(Some(vec![]), vec![5]).plan(3).unwrap(),
            (vec![], Some(vec![]))
        );
        let bad = |r: ResetRequest| r.plan(3).unwrap_err();
        let e = bad(req(Some(vec![0, 3]), vec![1, 2, 3]));
        assert_eq!(e.code, code::BAD_REQUEST);
        assert!(
            e.message.contains("env id 3"),
            "ids are checked first: {}",
            e.message
        );
        let e = bad(req(None, vec![1, 2]));
        assert_eq!(e.code, code::BAD_REQUEST);
        assert!(e.message.contains("2 seeds for 3 envs"), "{}", e.message);
    }
}
