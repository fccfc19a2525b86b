//! The wire format's tests: round trips, envelopes refused as invalid or out of range,
//! and garbage, truncations and mutations that must never panic.

use super::*;
use proptest::prelude::*;

#[test]
fn peek_id_reads_the_id_of_a_semantically_invalid_envelope() {
    // A request carrying an error: verifiable FlatBuffers, refused by `decode`.
    let mut env = Envelope::request(77, Method::Ping, Body::Ping(vec![1]));
    env.error = Some((3, "no".into()));
    let bytes = env.encode();
    assert!(Envelope::decode(&bytes).is_err());
    assert_eq!(Envelope::peek_id(&bytes), Some(77));
    assert_eq!(Envelope::peek_id(b"garbage"), None);
}

fn s(x: &str) -> String {
    x.to_string()
}

fn pairs(xs: &[(&str, &str)]) -> Vec<(String, String)> {
    xs.iter().map(|(k, v)| (s(k), s(v))).collect()
}

fn req(id: u64, method: Method, body: Body) -> Envelope {
    Envelope::request(id, method, body)
}

fn rep(id: u64, method: Method, body: Body) -> Envelope {
    Envelope::reply(id, method, body)
}

fn err(id: u64, method: Method, code: u16, message: &str) -> Envelope {
    Envelope::error_reply(id, method, code, message)
}

fn custom(name: &str) -> Method {
    Method::Custom(s(name))
}

fn every_tensor() -> Vec<TensorSchema> {
    let mut out = Vec::new();
    for (i, dtype) in DType::ALL.into_iter().enumerate() {
        out.push(TensorSchema {
            name: format!("t{i}_{dtype}"),
            dtype,
            shape: (0..=(i as u64 % 9)).map(|d| d * 1000 + 1).collect(),
            direction: if i % 2 == 0 {
                Direction::EngineToClient
            } else {
                Direction::ClientToEngine
            },
            location: [Location::Host, Location::Cuda, Location::Vulkan][i % 3],
        });
    }
    out.push(TensorSchema {
        name: String::new(),
        dtype: DType::F32,
        shape: vec![],
        direction: Direction::EngineToClient,
        location: Location::Host,
    });
    out.push(TensorSchema {
        name: s("huge"),
        dtype: DType::U64,
        shape: vec![u64::MAX, 0, 1],
        direction: Direction::ClientToEngine,
        location: Location::Host,
    });
    out
}

/// Every message type, request and reply forms, error replies, Custom with and
/// without args and payload, empty and full optional fields.
fn samples() -> Vec<Envelope> {
    let hello = Body::Hello {
        protocol_major: 1,
        protocol_minor: 2,
        pid: 4242,
        client_name: s("train.py"),
    };
    let welcome = Body::Welcome {
        protocol_major: 1,
        protocol_minor: 0,
        engine_pid: u32::MAX,
        engine_kind: s("cartpole"),
    };
    let schema = Body::Schema {
        num_envs: 4096,
        engine_kind: s("cartpole"),
        tensors: every_tensor(),
        metadata: pairs(&[
            ("observation_low", "[-4.8, -inf, -0.418, -inf]"),
            ("action_space", "discrete(2)"),
            ("autoreset_mode", "next_step"),
            ("", ""),
        ]),
    };
    let mut all = vec![
        // Hello / Welcome.
        req(1, Method::Hello, hello),
        req(
            0,
            Method::Hello,
            Body::Hello {
                protocol_major: 0,
                protocol_minor: 0,
                pid: 0,
                client_name: String::new(),
            },
        ),
        rep(1, Method::Hello, welcome),
        rep(
            u64::MAX,
            Method::Hello,
            Body::Welcome {
                protocol_major: u16::MAX,
                protocol_minor: u16::MAX,
                engine_pid: 0,
                engine_kind: s("ünïcødé ✓"),
            },
        ),
        err(
            1,
            Method::Hello,
            code::UNSUPPORTED,
            "protocol 9.0 is not spoken here",
        ),
        // GetSchema / Schema.
        req(2, Method::GetSchema, Body::GetSchema),
        req(2, Method::GetSchema, Body::None),
        rep(2, Method::GetSchema, schema),
        rep(
            3,
            Method::GetSchema,
            Body::Schema {
                num_envs: 0,
                engine_kind: String::new(),
                tensors: vec![],
                metadata: vec![],
            },
        ),
        err(2, Method::GetSchema, code::ENGINE_ERROR, ""),
        // Reset / ResetDone.
        req(4, Method::Reset, Body::None),
        req(
            4,
            Method::Reset,
            Body::Reset {
                env_ids: None,
                seeds: vec![],
                options: vec![],
            },
        ),
        req(
            5,
            Method::Reset,
            Body::Reset {
                env_ids: Some(vec![]),
                seeds: vec![],
                options: vec![],
            },
        ),
        req(
            6,
            Method::Reset,
            Body::Reset {
                env_ids: None,
                seeds: vec![12345],
                options: pairs(&[("difficulty", "3")]),
            },
        ),
        req(
            7,
            Method::Reset,
            Body::Reset {
                env_ids: Some(vec![0, 3, u32::MAX]),
                seeds: vec![1, 0, u64::MAX],
                options: pairs(&[("a", "1"), ("b", "two")]),
            },
        ),
        req(
            8,
            Method::Reset,
            Body::Reset {
                env_ids: Some(vec![9]),
                seeds: vec![7],
                options: vec![],
            },
        ),
        rep(7, Method::Reset, Body::ResetDone { frame: 0 }),
        rep(8, Method::Reset, Body::ResetDone { frame: u64::MAX }),
        err(
            7,
            Method::Reset,
            code::BAD_REQUEST,
            "env id 4294967295 >= num_envs 4096",
        ),
        // Close.
        req(9, Method::Close, Body::Close),
        req(9, Method::Close, Body::None),
        rep(9, Method::Close, Body::None),
        rep(9, Method::Close, Body::Close),
        err(9, Method::Close, code::ENGINE_ERROR, "flush failed"),
        // Ping / Pong.
        req(10, Method::Ping, Body::Ping(vec![])),
        req(10, Method::Ping, Body::Ping((0..=255).collect())),
        req(10, Method::Ping, Body::None),
        rep(10, Method::Ping, Body::Pong(vec![])),
        rep(10, Method::Ping, Body::Pong((0..=255).rev().collect())),
        err(10, Method::Ping, code::ENGINE_ERROR, "busy"),
        // Custom.
        req(11, custom("set_gravity"), Body::None),
        Envelope {
            args: pairs(&[("g", "9.81"), ("unit", "m/s²"), ("empty", "")]),
            payload: vec![0, 1, 2, 3, 0xff],
            ..req(12, custom("set_gravity"), Body::None)
        },
        Envelope {
            payload: vec![0xaa; 1000],
            ..req(13, custom("x"), Body::None)
        },
        Envelope {
            args: pairs(&[("old", "9.81")]),
            ..req(14, custom("render"), Body::None)
        },
        rep(11, custom("set_gravity"), Body::None),
        Envelope {
            args: pairs(&[("width", "640"), ("height", "480")]),
            payload: vec![7; 640],
            ..rep(12, custom("render"), Body::None)
        },
        err(
            13,
            custom("no_such_method"),
            code::UNKNOWN_METHOD,
            "no method 'no_such_method'",
        ),
        err(14, custom("m"), u16::MAX, "an engine-defined code"),
        // Built-ins may carry args and payload too.
        Envelope {
            args: pairs(&[("trace", "1")]),
            payload: vec![1],
            ..req(15, Method::Reset, Body::None)
        },
    ];
    // Error replies with every code, and both ids at their extremes.
    for c in [
        code::UNKNOWN_METHOD,
        code::BAD_REQUEST,
        code::ENGINE_ERROR,
        code::UNSUPPORTED,
    ] {
        all.push(err(u64::MAX, Method::GetSchema, c, "x"));
    }
    all
}

/// Decode must answer `Ok` or `BadMessage`, nothing else (and never panic).
#[track_caller]
fn ok_or_bad(bytes: &[u8]) -> Option<Envelope> {
    match Envelope::decode(bytes) {
        Ok(e) => {
            // Whatever decodes re-encodes to the same thing.
            let again = Envelope::decode(&e.encode()).expect("re-encoded envelope decodes");
            assert_eq!(again, e);
            Some(e)
        }
        Err(Error::BadMessage(_)) => None,
        Err(other) => panic!("decode returned {other:?}, not BadMessage"),
    }
}

#[track_caller]
fn assert_bad(bytes: &[u8], needle: &str) {
    match Envelope::decode(bytes) {
        Err(Error::BadMessage(m)) => assert!(m.contains(needle), "'{m}' lacks '{needle}'"),
        other => panic!("expected BadMessage containing '{needle}', got {other:?}"),
    }
}

/// A SplitMix64 stream: deterministic garbage without a dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[test]
fn round_trip_every_message() {
    let all = samples();
    let mut methods = std::collections::HashSet::new();
    let mut bodies = std::collections::HashSet::new();
    for e in &all {
        e.validate().unwrap_or_else(|err| panic!("{e:?}: {err}"));
        let bytes = e.encode();
        assert_eq!(&bytes[4..8], b"SHMB");
        let back = Envelope::decode(&bytes).unwrap_or_else(|err| panic!("{e:?}: {err}"));
        assert_eq!(&back, e);
        // Nothing assumes the buffer is aligned in memory.
        let mut shifted = vec![0u8; 1];
        shifted.extend_from_slice(&bytes);
        assert_eq!(&Envelope::decode(&shifted[1..]).unwrap(), e);
        methods.insert(std::mem::discriminant(&e.method));
        bodies.insert((e.body.tag(), e.kind == Kind::Reply, e.error.is_some()));
    }
    assert_eq!(methods.len(), 6, "every method");
    for tag in fb::Body::ENUM_VALUES {
        assert!(
            bodies.iter().any(|b| b.0 == *tag),
            "body {:?} not covered",
            tag.variant_name()
        );
    }
}

#[test]
fn encode_into_reuses_a_builder() {
    let mut fbb = FlatBufferBuilder::new();
    for e in samples().iter().chain(samples().iter().rev()) {
        let bytes = e.encode_into(&mut fbb).to_vec();
        assert_eq!(bytes, e.encode());
        assert_eq!(&Envelope::decode(&bytes).unwrap(), e);
    }
}

#[test]
fn constructors_and_into_result() {
    let r = Envelope::request(5, Method::Reset, Body::None);
    assert_eq!(r.kind, Kind::Request);
    let ok = Envelope::reply(r.id, r.method.clone(), Body::ResetDone { frame: 3 });
    assert_eq!(
        (ok.id, ok.kind, &ok.method),
        (5, Kind::Reply, &Method::Reset)
    );
    ok.validate().unwrap();
    assert_eq!(ok.clone().into_result().unwrap(), ok);
    let e = Envelope::error_reply(5, Method::Reset, code::BAD_REQUEST, "env 9 out of range");
    assert_eq!((e.id, e.kind, &e.body), (5, Kind::Reply, &Body::None));
    e.validate().unwrap();
    let decoded = Envelope::decode(&e.encode()).unwrap();
    match decoded.into_result() {
        Err(Error::Remote {
            method,
            code,
            message,
        }) => {
            assert_eq!((method.as_str(), code), ("reset", code::BAD_REQUEST));
            assert_eq!(message, "env 9 out of range");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(custom("render").name(), "render");
    assert_eq!(Method::GetSchema.to_string(), "get_schema");
}

#[test]
fn tensor_schema_from_info() {
    let info = TensorInfo {
        name: s("obs"),
        dtype: DType::BF16,
        shape: vec![8, 4],
        direction: Direction::EngineToClient,
        device: crate::device::Device::Host,
        offset: 4096,
        nbytes: 64,
        cuda: None,
        vulkan: None,
    };
    let t = TensorSchema::from_info(&info);
    assert_eq!(t, TensorSchema::from(&info));
    assert_eq!(
        (t.name.as_str(), t.dtype, &t.shape[..]),
        ("obs", DType::BF16, &[8u64, 4][..])
    );
    assert_eq!((t.direction, t.location), (info.direction, info.location()));
}

#[test]
fn semantically_invalid_envelopes_are_rejected() {
    let cases: Vec<(Envelope, &str)> = vec![
        (req(1, custom(""), Body::None), "without a name"),
        (
            Envelope {
                error: Some((code::BAD_REQUEST, s("x"))),
                ..req(1, Method::Ping, Body::None)
            },
            "carries an error",
        ),
        (req(1, Method::Hello, Body::None), "expected Hello"),
        (
            req(1, Method::Hello, Body::Pong(vec![])),
            "has body Pong, expected Hello",
        ),
        (req(1, custom("m"), Body::Close), "expected NONE"),
        (rep(1, Method::Reset, Body::GetSchema), "expected ResetDone"),
        (rep(1, Method::Reset, Body::None), "expected ResetDone"),
        (
            rep(1, Method::Close, Body::Pong(vec![])),
            "expected Close or NONE",
        ),
        (rep(1, Method::Ping, Body::Ping(vec![])), "expected Pong"),
        (
            rep(
                1,
                Method::Hello,
                Body::Hello {
                    protocol_major: 1,
                    protocol_minor: 0,
                    pid: 1,
                    client_name: s("c"),
                },
            ),
            "expected Welcome",
        ),
        (
            req(
                1,
                Method::GetSchema,
                Body::Schema {
                    num_envs: 1,
                    engine_kind: s("k"),
                    tensors: vec![],
                    metadata: vec![],
                },
            ),
            "expected GetSchema or NONE",
        ),
        (
            Envelope {
                error: Some((code::ENGINE_ERROR, s("x"))),
                ..rep(1, Method::Reset, Body::ResetDone { frame: 1 })
            },
            "error reply 1 (reset) has body ResetDone",
        ),
        (
            req(
                1,
                Method::Reset,
                Body::Reset {
                    env_ids: Some(vec![0, 1, 2]),
                    seeds: vec![1, 2],
                    options: vec![],
                },
            ),
            "3 envs with 2 seeds",
        ),
    ];
    // Error code 0 means success on the wire: such an envelope encodes as an ok reply.
    let zero = err(1, Method::Close, 0, "zero");
    assert!(matches!(zero.validate(), Err(Error::BadMessage(m)) if m.contains("error code 0")));
    assert_eq!(
        Envelope::decode(&zero.encode()).unwrap(),
        rep(1, Method::Close, Body::None)
    );
    for (e, needle) in cases {
        assert!(matches!(e.validate(), Err(Error::BadMessage(_))), "{e:?}");
        assert_bad(&e.encode(), needle);
    }
}

/// Builds an envelope with raw (possibly invalid) enum values and a given body.
fn raw(
    kind: u8,
    method: u8,
    body_type: u8,
    body: impl FnOnce(&mut FlatBufferBuilder<'static>) -> Option<WIPOffset<flatbuffers::UnionWIPOffset>>,
) -> Vec<u8> {
    let mut fbb = FlatBufferBuilder::new();
    let body = body(&mut fbb);
    let method_name = Some(fbb.create_string("m"));
    let root = fb::Envelope::create(
        &mut fbb,
        &fb::EnvelopeArgs {
            id: 1,
            kind: fb::Kind(kind),
            method: fb::Method(method),
            method_name,
            body_type: fb::Body(body_type),
            body,
            args: None,
            payload: None,
            error_code: 0,
            error_message: None,
        },
    );
    fb::finish_envelope_buffer(&mut fbb, root);
    fbb.finished_data().to_vec()
}

fn schema_with(
    dtype_code: u8,
    dtype_bits: u8,
    direction: u8,
    location: u8,
) -> impl FnOnce(&mut FlatBufferBuilder<'static>) -> Option<WIPOffset<flatbuffers::UnionWIPOffset>>
{
    move |fbb| {
        let name = Some(fbb.create_string("obs"));
        let shape = Some(fbb.create_vector(&[4u64, 2]));
        let t = fb::TensorSchema::create(
            fbb,
            &fb::TensorSchemaArgs {
                name,
                dtype_code,
                dtype_bits,
                shape,
                direction,
                location,
            },
        );
        let tensors = Some(fbb.create_vector(&[t]));
        let args = fb::SchemaArgs {
            num_envs: 4,
            engine_kind: None,
            tensors,
            metadata: None,
        };
        Some(fb::Schema::create(fbb, &args).as_union_value())
    }
}

#[test]
fn out_of_range_values_are_rejected() {
    let reply = fb::Kind::Reply.0;
    let get_schema = fb::Method::GetSchema.0;
    let schema = fb::Body::Schema.0;
    // The raw builder itself makes valid envelopes.
    let good = raw(reply, get_schema, schema, schema_with(2, 32, 1, 2));
    match Envelope::decode(&good).unwrap().body {
        Body::Schema { tensors, .. } => {
            assert_eq!(tensors[0].dtype, DType::F32);
            assert_eq!(tensors[0].direction, Direction::ClientToEngine);
            assert_eq!(tensors[0].location, Location::Vulkan);
        }
        other => panic!("{other:?}"),
    }
    assert_bad(&raw(2, get_schema, 0, |_| None), "unknown kind 2");
    assert_bad(&raw(255, get_schema, 0, |_| None), "unknown kind 255");
    assert_bad(&raw(0, 6, 0, |_| None), "unknown method 6");
    assert_bad(&raw(0, 255, 0, |_| None), "unknown method 255");
    let close = |fbb: &mut FlatBufferBuilder<'static>| {
        Some(fb::Close::create(fbb, &fb::CloseArgs {}).as_union_value())
    };
    assert_bad(
        &raw(0, fb::Method::Close.0, 10, close),
        "unknown body type 10",
    );
    assert_bad(
        &raw(0, fb::Method::Close.0, 255, close),
        "unknown body type 255",
    );
    // A body type without a body, and a body without a type.
    assert_bad(
        &raw(0, fb::Method::Close.0, fb::Body::Close.0, |_| None),
        "not a valid envelope",
    );
    assert_bad(
        &raw(0, fb::Method::Close.0, 0, close),
        "not a valid envelope",
    );
    // DLPack codes and enums inside a tensor.
    let bad_schema = |c, b, d, l| raw(reply, get_schema, schema, schema_with(c, b, d, l));
    assert_bad(
        &bad_schema(3, 32, 0, 0),
        "unknown dtype (DLPack code 3, bits 32)",
    );
    assert_bad(
        &bad_schema(2, 8, 0, 0),
        "unknown dtype (DLPack code 2, bits 8)",
    );
    assert_bad(&bad_schema(6, 1, 0, 0), "unknown dtype");
    assert_bad(&bad_schema(2, 32, 2, 0), "unknown direction 2");
    assert_bad(&bad_schema(2, 32, 0, 3), "unknown location 3");
    // A Custom method with no name at all (absent, not empty).
    let mut fbb = FlatBufferBuilder::new();
    let root = fb::Envelope::create(
        &mut fbb,
        &fb::EnvelopeArgs {
            id: 1,
            kind: fb::Kind::Request,
            method: fb::Method::Custom,
            method_name: None,
            body_type: fb::Body::NONE,
            body: None,
            args: None,
            payload: None,
            error_code: 0,
            error_message: None,
        },
    );
    fb::finish_envelope_buffer(&mut fbb, root);
    assert_bad(fbb.finished_data(), "custom method without a name");
    // A valid envelope without the file identifier.
    let mut fbb = FlatBufferBuilder::new();
    let method_name = Some(fbb.create_string("m"));
    let root = fb::Envelope::create(
        &mut fbb,
        &fb::EnvelopeArgs {
            method_name,
            ..fb::EnvelopeArgs::default()
        },
    );
    fbb.finish(root, None);
    assert_bad(fbb.finished_data(), "SHMB");
    // The empty buffer, and the smallest buffers.
    for n in 0..16 {
        assert!(Envelope::decode(&vec![0u8; n]).is_err());
    }
}

#[test]
fn garbage_never_panics() {
    let mut rng = Rng(0x5eed);
    let mut oks = 0;
    for i in 0..50_000 {
        let len = rng.below(if i % 10 == 0 { 4096 } else { 160 });
        let mut bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        // Often plant a plausible root offset and the identifier, to get past the
        // first checks into tables, vtables and unions.
        if len >= 8 && i % 2 == 0 {
            let root = 8 + 4 * rng.below((len - 8) / 4 + 1) as u32;
            bytes[..4].copy_from_slice(&root.to_le_bytes());
            bytes[4..8].copy_from_slice(b"SHMB");
        }
        // And sometimes make small values (offsets, lengths) much more likely.
        if i % 3 == 0 {
            for b in bytes.iter_mut().skip(8) {
                if rng.below(4) != 0 {
                    *b = (*b % 16) * (rng.below(2) as u8);
                }
            }
        }
        oks += ok_or_bad(&bytes).is_some() as usize;
    }
    eprintln!("{oks} of 50000 random buffers decoded");
}

#[test]
fn truncated_envelopes_never_panic() {
    for e in samples() {
        let bytes = e.encode();
        for len in 0..bytes.len() {
            let decoded = ok_or_bad(&bytes[..len]);
            if len < 8 {
                assert!(decoded.is_none());
            }
        }
        // Trailing bytes after a valid envelope are ignored.
        let mut longer = bytes.clone();
        longer.extend_from_slice(&[0xee; 13]);
        assert_eq!(ok_or_bad(&longer), Some(e));
    }
}

#[test]
fn byte_flips_never_panic() {
    let masks = [0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80, 0xff];
    let mut changed = 0;
    let mut total = 0;
    for e in samples() {
        let bytes = e.encode();
        for at in 0..bytes.len() {
            for mask in masks {
                let mut b = bytes.clone();
                b[at] ^= mask;
                total += 1;
                if ok_or_bad(&b).as_ref() != Some(&e) {
                    changed += 1;
                }
            }
        }
    }
    eprintln!("{changed} of {total} single-byte flips were rejected or changed the envelope");
    assert!(changed > 0);
}

#[test]
fn multi_byte_mutations_never_panic() {
    let all: Vec<Vec<u8>> = samples().iter().map(Envelope::encode).collect();
    let mut rng = Rng(7);
    for _ in 0..30_000 {
        let mut b = all[rng.below(all.len())].clone();
        for _ in 0..1 + rng.below(6) {
            let at = rng.below(b.len());
            b[at] = match rng.below(4) {
                0 => 0,
                1 => 0xff,
                2 => b[at].wrapping_add(1 + rng.below(8) as u8),
                _ => rng.next() as u8,
            };
        }
        ok_or_bad(&b);
    }
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        ok_or_bad(&bytes);
    }

    #[test]
    fn arbitrary_bytes_after_identifier_never_panic(
        root in 8u32..64,
        tail in proptest::collection::vec(any::<u8>(), 0..256),
    ) {
        let mut bytes = root.to_le_bytes().to_vec();
        bytes.extend_from_slice(b"SHMB");
        bytes.extend_from_slice(&tail);
        ok_or_bad(&bytes);
    }

    #[test]
    fn custom_envelopes_round_trip(
        id in any::<u64>(),
        reply in any::<bool>(),
        name in "[a-z_]{1,16}",
        args in proptest::collection::vec(("\\PC{0,8}", "\\PC{0,8}"), 0..5),
        payload in proptest::collection::vec(any::<u8>(), 0..64),
    ) {
        let e = Envelope {
            id,
            kind: if reply { Kind::Reply } else { Kind::Request },
            method: Method::Custom(name),
            body: Body::None,
            args,
            payload,
            error: None,
        };
        prop_assert_eq!(Envelope::decode(&e.encode()).unwrap(), e);
    }
}
