//! A command backlog never wedges the pair: calls that time out while the engine is busy
//! pile up until the request ring is full (`CommandBacklog`, a typed error, nothing
//! sent); once the engine serves again it answers them but drops every reply nobody waits
//! for (a request queued behind it, or an action posted, means its call has returned), so
//! it never waits on a full reply ring and the session keeps stepping.

use std::sync::mpsc;
use std::time::Duration;

use shmbridge::command::{CommandError, CommandHandler, Reply};
use shmbridge::tensor::Tensors;
use shmbridge::{AttachOptions, Client, DType, Engine, EngineSpec, Error, Peer};

const T: Duration = Duration::from_secs(30);
/// Each ring: room for three requests of the payload below, and three of its echoes.
const RING: u64 = 4096;
const PAYLOAD: usize = 1000;

/// Echoes the payload of method `slow`, once the test lets it through (one token each).
struct Gated(mpsc::Receiver<()>);

impl CommandHandler for Gated {
    fn call(
        &mut self,
        _io: &mut Tensors<'_>,
        method: &str,
        _args: &[(String, String)],
        payload: &[u8],
    ) -> Result<Reply, CommandError> {
        if method == "slow" {
            let _ = self.0.recv();
        }
        Ok(Reply {
            args: Vec::new(),
            payload: payload.to_vec(),
        })
    }
}

/// Before the fix: the pushes that found no room ended in a plain `Timeout`, and the
/// engine pushed every stale echo, waiting up to 5 s for room for each one the ring
/// could not take while the client only stepped.
#[test]
fn a_backlog_of_timed_out_calls_is_typed_and_the_pair_keeps_stepping() {
    let spec = EngineSpec::standard("backlog", 2, 3, 1, DType::F32).ring_capacity(RING);
    let mut engine = Engine::create(spec).unwrap();
    engine.publish().unwrap();
    let name = engine.name().to_string();
    let (gate, gated) = mpsc::channel();
    let served = std::thread::spawn(move || {
        let mut handler = Gated(gated);
        let mut steps = 0;
        loop {
            match engine.wait_actions_with(T, &mut handler) {
                Ok(_) => {
                    engine.publish().unwrap();
                    steps += 1;
                }
                Err(Error::PeerClosed { peer: Peer::Client }) => {
                    return (steps, engine.dropped_replies())
                }
                Err(e) => panic!("engine: {e}"),
            }
        }
    });
    let mut client = Client::attach(&name, AttachOptions::default()).unwrap();
    let payload = vec![7u8; PAYLOAD];
    // The engine holds the first call in its handler; every call times out, and the
    // requests pile up until one finds no room.
    let mut sent = 0;
    let backlog = loop {
        match client.call_method("slow", &[], &payload, Duration::from_millis(20)) {
            // Sent: the reply did not come in time. The request ring holds at most four.
            Err(Error::Timeout { what, .. }) if what == "a command-channel message" => sent += 1,
            Err(e) => break e,
            Ok(r) => panic!("a reply while the engine is held: {r:?}"),
        }
    };
    match backlog {
        Error::CommandBacklog { queued, capacity } => {
            assert!(queued > 0 && queued <= capacity && capacity == RING);
        }
        other => panic!("expected CommandBacklog, got {other}"),
    }
    assert!(sent >= 3, "{sent} calls sent");
    // The engine is let through every held call; the client only steps meanwhile.
    for _ in 0..sent {
        gate.send(()).unwrap();
    }
    for k in 1..=5 {
        assert_eq!(client.step(T).unwrap(), k);
    }
    // A new call gets its own reply, past whatever the engine still left for old ones.
    assert_eq!(client.ping(b"fresh", T).unwrap(), b"fresh");
    client.close();
    let (steps, dropped) = served.join().unwrap();
    assert_eq!(steps, 5);
    // Every held call was answered, and every reply but maybe the last dropped: the
    // last is dropped too if the client's first step was posted before it was pushed,
    // else it waited in the ring until the next call drained it.
    assert!(
        dropped == sent || dropped == sent - 1,
        "{dropped} of {sent}"
    );
}
