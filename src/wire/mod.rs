//! The command channel's messages: an owned, safe model of the FlatBuffers `Envelope` of
//! `schema/shmbridge.fbs`, and its codec.
//!
//! Nothing outside this module touches FlatBuffers: a sender builds an [`Envelope`] and
//! calls [`Envelope::encode`] (or [`Envelope::encode_into`] to reuse a builder's memory);
//! a receiver calls [`Envelope::decode`], which runs the FlatBuffers verifier and then
//! checks everything the schema cannot say (enum ranges, which body goes with which
//! method, DLPack codes), so whatever it returns is well formed. Decoding never panics,
//! whatever the bytes: anything malformed is [`Error::BadMessage`].
//!
//! The generated code (`shmbridge_generated.rs`) is written by
//! `scripts/gen-flatbuffers.sh`; do not edit it by hand.

use flatbuffers::{FlatBufferBuilder, ForwardsUOffset, Vector, VerifierOptions, WIPOffset};

use crate::error::{Error, Result};
use crate::layout::{DType, Direction, Location, TensorInfo};

#[allow(
    clippy::all,
    clippy::pedantic,
    unsafe_op_in_unsafe_fn,
    unused_imports,
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    dead_code,
    deprecated,
    missing_docs,
    rustdoc::all
)]
#[rustfmt::skip]
mod shmbridge_generated;

use shmbridge_generated::shmbridge::wire as fb;

/// Error codes of a failed reply (`Envelope::error`); 0 on the wire means success.
pub mod code {
    /// The engine does not know the method (an unknown `Custom` name).
    pub const UNKNOWN_METHOD: u16 = 1;
    /// The request is malformed or its arguments are invalid (bad env id, seed count, ...).
    pub const BAD_REQUEST: u16 = 2;
    /// The engine failed while carrying out a valid request.
    pub const ENGINE_ERROR: u16 = 3;
    /// The engine knows the method but does not support it (or these arguments).
    pub const UNSUPPORTED: u16 = 4;
}

/// Limits of the verifier in [`Envelope::decode`]. Honest envelopes are a few tables deep;
/// the apparent size is about the encoded size, so an envelope may carry up to ~64 MiB.
const VERIFIER_OPTIONS: VerifierOptions = VerifierOptions {
    max_depth: 64,
    max_tables: 100_000,
    max_apparent_size: 64 << 20,
    ignore_missing_null_terminator: false,
};

/// Request (client → engine) or reply (engine → client).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Request,
    Reply,
}

/// The operation an envelope asks for or answers.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Method {
    /// An engine-defined method, by name (never empty); arguments and result travel in
    /// [`Envelope::args`] and [`Envelope::payload`], and the body is [`Body::None`].
    Custom(String),
    Hello,
    GetSchema,
    Reset,
    Close,
    Ping,
}

impl Method {
    /// A name for messages and [`Error::Remote`]: `hello`, `get_schema`, `reset`, `close`,
    /// `ping`, or the custom method's own name.
    pub fn name(&self) -> &str {
        match self {
            Method::Custom(name) => name,
            Method::Hello => "hello",
            Method::GetSchema => "get_schema",
            Method::Reset => "reset",
            Method::Close => "close",
            Method::Ping => "ping",
        }
    }
}

impl std::fmt::Display for Method {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The typed body of a built-in method's request or reply.
///
/// Which body goes with which method ([`Envelope::validate`] checks it):
///
/// | method      | request                  | ok reply           | error reply |
/// |-------------|--------------------------|--------------------|-------------|
/// | `Custom`    | `None`                   | `None`             | `None`      |
/// | `Hello`     | `Hello`                  | `Welcome`          | `None`      |
/// | `GetSchema` | `GetSchema` or `None`    | `Schema`           | `None`      |
/// | `Reset`     | `Reset` or `None` (all)  | `ResetDone`        | `None`      |
/// | `Close`     | `Close` or `None`        | `Close` or `None`  | `None`      |
/// | `Ping`      | `Ping` or `None` (empty) | `Pong`             | `None`      |
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Body {
    None,
    Hello {
        protocol_major: u16,
        protocol_minor: u16,
        pid: u32,
        client_name: String,
    },
    Welcome {
        protocol_major: u16,
        protocol_minor: u16,
        engine_pid: u32,
        engine_kind: String,
    },
    GetSchema,
    Schema {
        num_envs: u32,
        engine_kind: String,
        /// In tensor-table order.
        tensors: Vec<TensorSchema>,
        /// Observation/action bounds, autoreset mode, ...
        metadata: Vec<(String, String)>,
    },
    Reset {
        /// `None`: every environment.
        env_ids: Option<Vec<u32>>,
        /// Empty (keep the RNG state), one (a base seed) or one per reset environment.
        seeds: Vec<u64>,
        options: Vec<(String, String)>,
    },
    ResetDone {
        /// The frame number the tensors now hold.
        frame: u64,
    },
    Close,
    Ping(Vec<u8>),
    Pong(Vec<u8>),
}

impl Body {
    fn tag(&self) -> fb::Body {
        match self {
            Body::None => fb::Body::NONE,
            Body::Hello { .. } => fb::Body::Hello,
            Body::Welcome { .. } => fb::Body::Welcome,
            Body::GetSchema => fb::Body::GetSchema,
            Body::Schema { .. } => fb::Body::Schema,
            Body::Reset { .. } => fb::Body::Reset,
            Body::ResetDone { .. } => fb::Body::ResetDone,
            Body::Close => fb::Body::Close,
            Body::Ping(_) => fb::Body::Ping,
            Body::Pong(_) => fb::Body::Pong,
        }
    }
}

/// One tensor as the `Schema` reply describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSchema {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub direction: Direction,
    pub location: Location,
}

impl TensorSchema {
    pub fn from_info(info: &TensorInfo) -> Self {
        TensorSchema {
            name: info.name.clone(),
            dtype: info.dtype,
            shape: info.shape.clone(),
            direction: info.direction,
            location: info.location(),
        }
    }
}

impl From<&TensorInfo> for TensorSchema {
    fn from(info: &TensorInfo) -> Self {
        TensorSchema::from_info(info)
    }
}

/// One command-channel message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    /// Correlation id: chosen by the requester, echoed by the reply.
    pub id: u64,
    pub kind: Kind,
    /// A reply repeats its request's method.
    pub method: Method,
    pub body: Body,
    /// An engine-defined method's named arguments (request) or results (reply).
    pub args: Vec<(String, String)>,
    /// An engine-defined method's opaque argument (request) or result (reply) bytes.
    pub payload: Vec<u8>,
    /// Replies only: `Some((code, message))` when the request failed; `code` is one of
    /// [`code`] (never 0).
    pub error: Option<(u16, String)>,
}

impl Envelope {
    /// A request with no args, payload or error.
    pub fn request(id: u64, method: Method, body: Body) -> Self {
        Envelope {
            id,
            kind: Kind::Request,
            method,
            body,
            args: Vec::new(),
            payload: Vec::new(),
            error: None,
        }
    }

    /// A successful reply (echo the request's id and method).
    pub fn reply(id: u64, method: Method, body: Body) -> Self {
        Envelope {
            kind: Kind::Reply,
            ..Envelope::request(id, method, body)
        }
    }

    /// A failed reply (echo the request's id and method); `code` is one of [`code`].
    pub fn error_reply(id: u64, method: Method, code: u16, message: impl Into<String>) -> Self {
        Envelope {
            error: Some((code, message.into())),
            ..Envelope::reply(id, method, Body::None)
        }
    }

    /// `Err(Error::Remote { .. })` for a failed reply, the envelope itself otherwise.
    pub fn into_result(self) -> Result<Envelope> {
        match self.error {
            Some((code, message)) => Err(Error::Remote {
                method: self.method.name().to_string(),
                code,
                message,
            }),
            None => Ok(self),
        }
    }

    /// Serializes the envelope. It is not validated: a sender that may build invalid
    /// envelopes should call [`Envelope::validate`] first, or the receiver's
    /// [`Envelope::decode`] rejects them. Panics only past FlatBuffers' 2 GiB buffer limit.
    pub fn encode(&self) -> Vec<u8> {
        let mut fbb = FlatBufferBuilder::new();
        self.encode_into(&mut fbb).to_vec()
    }

    /// [`Envelope::encode`] into a reusable builder (reset first); returns the finished
    /// bytes, which live until the builder's next use.
    pub fn encode_into<'b>(&self, fbb: &'b mut FlatBufferBuilder<'_>) -> &'b [u8] {
        fbb.reset();
        let method_name = match &self.method {
            Method::Custom(name) => Some(fbb.create_string(name)),
            _ => None,
        };
        let body = encode_body(fbb, &self.body);
        let args = encode_pairs(fbb, &self.args);
        let payload = (!self.payload.is_empty()).then(|| fbb.create_vector(&self.payload));
        let (error_code, error_message) = match &self.error {
            Some((code, message)) => (*code, Some(fbb.create_string(message))),
            None => (0, None),
        };
        let root = fb::Envelope::create(
            fbb,
            &fb::EnvelopeArgs {
                id: self.id,
                kind: match self.kind {
                    Kind::Request => fb::Kind::Request,
                    Kind::Reply => fb::Kind::Reply,
                },
                method: match self.method {
                    Method::Custom(_) => fb::Method::Custom,
                    Method::Hello => fb::Method::Hello,
                    Method::GetSchema => fb::Method::GetSchema,
                    Method::Reset => fb::Method::Reset,
                    Method::Close => fb::Method::Close,
                    Method::Ping => fb::Method::Ping,
                },
                method_name,
                body_type: self.body.tag(),
                body,
                args,
                payload,
                error_code,
                error_message,
            },
        );
        fb::finish_envelope_buffer(fbb, root);
        fbb.finished_data()
    }

    /// The correlation id of a buffer that passes the FlatBuffers verifier, even if the
    /// envelope is otherwise invalid: lets the engine address its error reply.
    pub fn peek_id(bytes: &[u8]) -> Option<u64> {
        flatbuffers::root_with_opts::<fb::Envelope>(&VERIFIER_OPTIONS, bytes)
            .ok()
            .map(|root| root.id())
    }

    /// Parses and checks an envelope: the FlatBuffers verifier (file identifier `SHMB`,
    /// depth ≤ 64, ≤ 100 000 tables, apparent size ≤ 64 MiB), then enum ranges, DLPack
    /// codes and [`Envelope::validate`]. Anything wrong is [`Error::BadMessage`]; never
    /// panics.
    pub fn decode(bytes: &[u8]) -> Result<Envelope> {
        let root = flatbuffers::root_with_opts::<fb::Envelope>(&VERIFIER_OPTIONS, bytes)
            .map_err(|e| bad(format!("not a valid envelope: {e}")))?;
        // The verifier has checked the root offset, so the buffer holds at least 4 bytes;
        // the identifier needs 4 more.
        if bytes.len() < 8 || !fb::envelope_buffer_has_identifier(bytes) {
            return Err(bad("missing the SHMB file identifier".into()));
        }
        let kind = match root.kind() {
            fb::Kind::Request => Kind::Request,
            fb::Kind::Reply => Kind::Reply,
            other => return Err(bad(format!("unknown kind {}", other.0))),
        };
        let method = match root.method() {
            fb::Method::Custom => Method::Custom(root.method_name().unwrap_or("").to_string()),
            fb::Method::Hello => Method::Hello,
            fb::Method::GetSchema => Method::GetSchema,
            fb::Method::Reset => Method::Reset,
            fb::Method::Close => Method::Close,
            fb::Method::Ping => Method::Ping,
            other => return Err(bad(format!("unknown method {}", other.0))),
        };
        let error = match root.error_code() {
            0 => None,
            code => Some((code, root.error_message().unwrap_or("").to_string())),
        };
        let env = Envelope {
            id: root.id(),
            kind,
            method,
            body: decode_body(&root)?,
            args: decode_pairs(root.args()),
            payload: root
                .payload()
                .map(|p| p.bytes().to_vec())
                .unwrap_or_default(),
            error,
        };
        env.validate()?;
        Ok(env)
    }

    /// Checks what the schema cannot: a `Custom` method has a name, only replies carry
    /// errors (with a non-zero code), the body matches the method and kind (see [`Body`]),
    /// and a reset's seeds are none, one or one per listed env.
    pub fn validate(&self) -> Result<()> {
        if matches!(&self.method, Method::Custom(name) if name.is_empty()) {
            return Err(bad("custom method without a name".into()));
        }
        match (&self.error, self.kind) {
            (Some(_), Kind::Request) => {
                return Err(bad(format!(
                    "request {} ({}) carries an error",
                    self.id, self.method
                )))
            }
            (Some((0, _)), Kind::Reply) => return Err(bad("error code 0".into())),
            _ => {}
        }
        let tag = self.body.tag();
        let allowed: &[fb::Body] = match (self.kind, self.error.is_some()) {
            (Kind::Reply, true) => &[fb::Body::NONE],
            (Kind::Request, _) => match self.method {
                Method::Custom(_) => &[fb::Body::NONE],
                Method::Hello => &[fb::Body::Hello],
                Method::GetSchema => &[fb::Body::GetSchema, fb::Body::NONE],
                Method::Reset => &[fb::Body::Reset, fb::Body::NONE],
                Method::Close => &[fb::Body::Close, fb::Body::NONE],
                Method::Ping => &[fb::Body::Ping, fb::Body::NONE],
            },
            (Kind::Reply, false) => match self.method {
                Method::Custom(_) => &[fb::Body::NONE],
                Method::Close => &[fb::Body::Close, fb::Body::NONE],
                Method::Hello => &[fb::Body::Welcome],
                Method::GetSchema => &[fb::Body::Schema],
                Method::Reset => &[fb::Body::ResetDone],
                Method::Ping => &[fb::Body::Pong],
            },
        };
        if !allowed.contains(&tag) {
            let kind = match (self.kind, self.error.is_some()) {
                (Kind::Request, _) => "request",
                (Kind::Reply, false) => "reply",
                (Kind::Reply, true) => "error reply",
            };
            let body = tag.variant_name().unwrap_or("?");
            return Err(bad(format!(
                "{kind} {} ({}) has body {body}, expected {}",
                self.id,
                self.method,
                allowed
                    .iter()
                    .map(|b| b.variant_name().unwrap_or("?"))
                    .collect::<Vec<_>>()
                    .join(" or ")
            )));
        }
        if let Body::Reset {
            env_ids: Some(ids),
            seeds,
            ..
        } = &self.body
        {
            if seeds.len() > 1 && seeds.len() != ids.len() {
                return Err(bad(format!(
                    "reset of {} envs with {} seeds (expected none, one, or one per env)",
                    ids.len(),
                    seeds.len()
                )));
            }
        }
        Ok(())
    }
}

fn bad(message: String) -> Error {
    Error::BadMessage(message)
}

type PairsOffset<'f> = WIPOffset<Vector<'f, ForwardsUOffset<fb::KeyValue<'f>>>>;

/// `None` for an empty list (absent on the wire reads back as empty).
fn encode_pairs<'f>(
    fbb: &mut FlatBufferBuilder<'f>,
    pairs: &[(String, String)],
) -> Option<PairsOffset<'f>> {
    if pairs.is_empty() {
        return None;
    }
    let items: Vec<_> = pairs
        .iter()
        .map(|(k, v)| {
            let key = Some(fbb.create_string(k));
            let value = Some(fbb.create_string(v));
            fb::KeyValue::create(fbb, &fb::KeyValueArgs { key, value })
        })
        .collect();
    Some(fbb.create_vector(&items))
}

fn decode_pairs(
    pairs: Option<Vector<'_, ForwardsUOffset<fb::KeyValue<'_>>>>,
) -> Vec<(String, String)> {
    pairs
        .map(|v| {
            v.iter()
                .map(|kv| {
                    (
                        kv.key().unwrap_or("").to_string(),
                        kv.value().unwrap_or("").to_string(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

fn encode_body(
    fbb: &mut FlatBufferBuilder<'_>,
    body: &Body,
) -> Option<WIPOffset<flatbuffers::UnionWIPOffset>> {
    let offset = match body {
        Body::None => return None,
        Body::Hello {
            protocol_major,
            protocol_minor,
            pid,
            client_name,
        } => {
            let client_name = Some(fbb.create_string(client_name));
            let args = fb::HelloArgs {
                protocol_major: *protocol_major,
                protocol_minor: *protocol_minor,
                pid: *pid,
                client_name,
            };
            fb::Hello::create(fbb, &args).as_union_value()
        }
        Body::Welcome {
            protocol_major,
            protocol_minor,
            engine_pid,
            engine_kind,
        } => {
            let engine_kind = Some(fbb.create_string(engine_kind));
            let args = fb::WelcomeArgs {
                protocol_major: *protocol_major,
                protocol_minor: *protocol_minor,
                engine_pid: *engine_pid,
                engine_kind,
            };
            fb::Welcome::create(fbb, &args).as_union_value()
        }
        Body::GetSchema => fb::GetSchema::create(fbb, &fb::GetSchemaArgs {}).as_union_value(),
        Body::Schema {
            num_envs,
            engine_kind,
            tensors,
            metadata,
        } => {
            let engine_kind = Some(fbb.create_string(engine_kind));
            let tensors: Vec<_> = tensors
                .iter()
                .map(|t| {
                    let name = Some(fbb.create_string(&t.name));
                    let shape = Some(fbb.create_vector(&t.shape));
                    let (dtype_code, dtype_bits) = t.dtype.dlpack();
                    let args = fb::TensorSchemaArgs {
                        name,
                        dtype_code,
                        dtype_bits,
                        shape,
                        direction: t.direction as u8,
                        location: t.location.code(),
                    };
                    fb::TensorSchema::create(fbb, &args)
                })
                .collect();
            let tensors = Some(fbb.create_vector(&tensors));
            let metadata = encode_pairs(fbb, metadata);
            let args = fb::SchemaArgs {
                num_envs: *num_envs,
                engine_kind,
                tensors,
                metadata,
            };
            fb::Schema::create(fbb, &args).as_union_value()
        }
        Body::Reset {
            env_ids,
            seeds,
            options,
        } => {
            let env_ids = env_ids.as_ref().map(|ids| fbb.create_vector(ids));
            let seeds = (!seeds.is_empty()).then(|| fbb.create_vector(seeds));
            let options = encode_pairs(fbb, options);
            let args = fb::ResetArgs {
                env_ids,
                seeds,
                options,
            };
            fb::Reset::create(fbb, &args).as_union_value()
        }
        Body::ResetDone { frame } => {
            fb::ResetDone::create(fbb, &fb::ResetDoneArgs { frame: *frame }).as_union_value()
        }
        Body::Close => fb::Close::create(fbb, &fb::CloseArgs {}).as_union_value(),
        Body::Ping(payload) => {
            let payload = Some(fbb.create_vector(payload));
            fb::Ping::create(fbb, &fb::PingArgs { payload }).as_union_value()
        }
        Body::Pong(payload) => {
            let payload = Some(fbb.create_vector(payload));
            fb::Pong::create(fbb, &fb::PongArgs { payload }).as_union_value()
        }
    };
    Some(offset)
}

fn decode_body(root: &fb::Envelope<'_>) -> Result<Body> {
    let missing = || bad(format!("body type {} without a body", root.body_type().0));
    Ok(match root.body_type() {
        fb::Body::NONE => Body::None,
        fb::Body::Hello => {
            let b = root.body_as_hello().ok_or_else(missing)?;
            Body::Hello {
                protocol_major: b.protocol_major(),
                protocol_minor: b.protocol_minor(),
                pid: b.pid(),
                client_name: b.client_name().unwrap_or("").to_string(),
            }
        }
        fb::Body::Welcome => {
            let b = root.body_as_welcome().ok_or_else(missing)?;
            Body::Welcome {
                protocol_major: b.protocol_major(),
                protocol_minor: b.protocol_minor(),
                engine_pid: b.engine_pid(),
                engine_kind: b.engine_kind().unwrap_or("").to_string(),
            }
        }
        fb::Body::GetSchema => {
            root.body_as_get_schema().ok_or_else(missing)?;
            Body::GetSchema
        }
        fb::Body::Schema => {
            let b = root.body_as_schema().ok_or_else(missing)?;
            let tensors = match b.tensors() {
                Some(v) => v.iter().map(decode_tensor).collect::<Result<Vec<_>>>()?,
                None => Vec::new(),
            };
            Body::Schema {
                num_envs: b.num_envs(),
                engine_kind: b.engine_kind().unwrap_or("").to_string(),
                tensors,
                metadata: decode_pairs(b.metadata()),
            }
        }
        fb::Body::Reset => {
            let b = root.body_as_reset().ok_or_else(missing)?;
            Body::Reset {
                env_ids: b.env_ids().map(|v| v.iter().collect()),
                seeds: b.seeds().map(|v| v.iter().collect()).unwrap_or_default(),
                options: decode_pairs(b.options()),
            }
        }
        fb::Body::ResetDone => {
            let b = root.body_as_reset_done().ok_or_else(missing)?;
            Body::ResetDone { frame: b.frame() }
        }
        fb::Body::Close => {
            root.body_as_close().ok_or_else(missing)?;
            Body::Close
        }
        fb::Body::Ping => {
            let b = root.body_as_ping().ok_or_else(missing)?;
            Body::Ping(b.payload().map(|p| p.bytes().to_vec()).unwrap_or_default())
        }
        fb::Body::Pong => {
            let b = root.body_as_pong().ok_or_else(missing)?;
            Body::Pong(b.payload().map(|p| p.bytes().to_vec()).unwrap_or_default())
        }
        other => return Err(bad(format!("unknown body type {}", other.0))),
    })
}

fn decode_tensor(t: fb::TensorSchema<'_>) -> Result<TensorSchema> {
    let name = t.name().unwrap_or("").to_string();
    let dtype = DType::from_dlpack(t.dtype_code(), t.dtype_bits(), 1).ok_or_else(|| {
        bad(format!(
            "tensor '{name}': unknown dtype (DLPack code {}, bits {})",
            t.dtype_code(),
            t.dtype_bits()
        ))
    })?;
    let direction = Direction::from_u8(t.direction()).ok_or_else(|| {
        bad(format!(
            "tensor '{name}': unknown direction {}",
            t.direction()
        ))
    })?;
    let location = Location::from_code(t.location()).ok_or_else(|| {
        bad(format!(
            "tensor '{name}': unknown location {}",
            t.location()
        ))
    })?;
    Ok(TensorSchema {
        name,
        dtype,
        shape: t.shape().map(|v| v.iter().collect()).unwrap_or_default(),
        direction,
        location,
    })
}

#[cfg(all(test, not(loom)))]
mod tests;
