//! The states of the two sides (`engine_state`, `client_state`), typed: the `u32` codes
//! `docs/protocol.md` lists, and `Unknown` for a code a peer wrote that this build does
//! not know (kept, never a panic).

/// `engine_state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineState {
    /// Created, frame 0 not yet published.
    Starting,
    /// Frame 0 published, serving.
    Ready,
    /// Closed cleanly.
    Closed,
    /// Declared dead.
    Invalidated,
    /// A code this build does not know.
    Unknown(u32),
}

impl EngineState {
    pub const fn from_code(code: u32) -> EngineState {
        match code {
            0 => EngineState::Starting,
            1 => EngineState::Ready,
            2 => EngineState::Closed,
            3 => EngineState::Invalidated,
            other => EngineState::Unknown(other),
        }
    }
    pub const fn code(self) -> u32 {
        match self {
            EngineState::Starting => 0,
            EngineState::Ready => 1,
            EngineState::Closed => 2,
            EngineState::Invalidated => 3,
            EngineState::Unknown(c) => c,
        }
    }
    pub const fn name(self) -> &'static str {
        match self {
            EngineState::Starting => "starting",
            EngineState::Ready => "ready",
            EngineState::Closed => "closed",
            EngineState::Invalidated => "invalidated",
            EngineState::Unknown(_) => "unknown",
        }
    }
}

/// `client_state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientState {
    /// No client attached (yet).
    None,
    /// A client is attached.
    Attached,
    /// Closed cleanly.
    Closed,
    /// Declared dead by the engine, which freed the slot.
    Invalidated,
    /// A client is claiming the slot (writing its pid and start time).
    Claiming,
    /// A code this build does not know.
    Unknown(u32),
}

impl ClientState {
    pub const fn from_code(code: u32) -> ClientState {
        match code {
            0 => ClientState::None,
            1 => ClientState::Attached,
            2 => ClientState::Closed,
            3 => ClientState::Invalidated,
            4 => ClientState::Claiming,
            other => ClientState::Unknown(other),
        }
    }
    pub const fn code(self) -> u32 {
        match self {
            ClientState::None => 0,
            ClientState::Attached => 1,
            ClientState::Closed => 2,
            ClientState::Invalidated => 3,
            ClientState::Claiming => 4,
            ClientState::Unknown(c) => c,
        }
    }
    pub const fn name(self) -> &'static str {
        match self {
            ClientState::None => "none",
            ClientState::Attached => "attached",
            ClientState::Claiming => "claiming",
            ClientState::Closed => "closed",
            ClientState::Invalidated => "invalidated",
            ClientState::Unknown(_) => "unknown",
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::control::DeviceImport;

    #[test]
    fn state_codes_round_trip_and_unknown_codes_are_kept() {
        for code in 0..6 {
            assert_eq!(EngineState::from_code(code).code(), code);
            assert_eq!(ClientState::from_code(code).code(), code);
            assert_eq!(DeviceImport::from_code(code).code(), code);
        }
        assert_eq!(EngineState::from_code(7), EngineState::Unknown(7));
        assert_eq!(EngineState::from_code(7).name(), "unknown");
        assert_eq!(ClientState::from_code(4).name(), "claiming");
        assert_eq!(
            ClientState::from_code(u32::MAX),
            ClientState::Unknown(u32::MAX)
        );
    }
}
