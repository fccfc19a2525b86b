//! Handles: what C holds instead of pointers to Rust objects.
//!
//! A handle is a 64-bit number, `kind << 60 | generation << 20 | (slot + 1)`, typed in C
//! as a pointer to an opaque struct and never dereferenced. The kind (spec, engine,
//! client, a stream's consumer, producer, reservation or record) is part of the number,
//! so a handle of one kind is never a handle of another: `shmb_engine_close(client)` is
//! `SHMB_INVALID_HANDLE`, whatever the numbers of the first objects of each kind. Each
//! slot of a [`Registry`] holds one object behind a mutex with the generation it was
//! handed out under; closing takes the object out and bumps the generation. So a call
//! with a closed handle finds an older generation (`SHMB_CLOSED`), a number this library
//! never handed out finds another kind, no slot or a newer generation
//! (`SHMB_INVALID_HANDLE`), NULL is `SHMB_INVALID_ARGUMENT`, and two threads in calls on
//! one handle get `SHMB_BUSY` rather than a data race: none of them can reach freed
//! memory. Slots are reused with a new generation, so memory stays bounded however many
//! engines and clients come and go; a slot whose 40-bit generation is used up is retired
//! instead of wrapping, so no number is ever handed out twice.

use std::sync::{Mutex, OnceLock, TryLockError};

use crate::status::{shmb_status, CResult, Fail};

const CHUNK: usize = 256;
const CHUNKS: usize = 256;

/// Bits of a handle: the slot (plus one) in the low 20, the generation in the next 40,
/// the kind in the top 4.
const SLOT_BITS: u32 = 20;
const GENERATION_BITS: u32 = 40;
const KIND_SHIFT: u32 = SLOT_BITS + GENERATION_BITS;
/// The last generation a slot is handed out under; closing it retires the slot.
const LAST_GENERATION: u64 = (1 << GENERATION_BITS) - 1;

// Handles are pointer-sized numbers with the kind in bits 60..64.
const _: () = assert!(
    usize::BITS == 64,
    "the C ABI's handles need 64-bit pointers"
);
const _: () = assert!(CHUNK * CHUNKS < 1 << SLOT_BITS);

/// The kinds of handle, each in its own registry.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
pub(crate) enum Kind {
    Spec = 1,
    Engine = 2,
    Client = 3,
    StreamConsumer = 4,
    StreamProducer = 5,
    StreamReservation = 6,
    StreamRecord = 7,
}

struct Slot<T> {
    generation: u64,
    value: Option<T>,
}

/// A lazily allocated block of `CHUNK` slots.
type Chunk<T> = OnceLock<Box<[Mutex<Slot<T>>]>>;

/// One kind of handle's objects.
pub(crate) struct Registry<T> {
    what: &'static str,
    kind: Kind,
    chunks: [Chunk<T>; CHUNKS],
    /// Free slots and the number of slots ever used (create and close only).
    free: Mutex<(Vec<u32>, u32)>,
}

impl<T> Registry<T> {
    pub(crate) const fn new(what: &'static str, kind: Kind) -> Self {
        Registry {
            what,
            kind,
            chunks: [const { OnceLock::new() }; CHUNKS],
            free: Mutex::new((Vec::new(), 0)),
        }
    }

    fn slot(&self, index: u32) -> Option<&Mutex<Slot<T>>> {
        let index = index as usize;
        let chunk = self.chunks.get(index / CHUNK)?.get()?;
        chunk.get(index % CHUNK)
    }

    /// Stores `value`; returns its handle.
    pub(crate) fn insert(&self, value: T) -> CResult<usize> {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        let index = match free.0.pop() {
            Some(i) => i,
            None => {
                let i = free.1;
                if i as usize >= CHUNK * CHUNKS {
                    return Err(Fail::invalid(format!(
                        "{} {}s are open at once, the most this library holds; close some",
                        CHUNK * CHUNKS,
                        self.what
                    )));
                }
                self.chunks[i as usize / CHUNK].get_or_init(|| {
                    (0..CHUNK)
                        .map(|_| {
                            Mutex::new(Slot {
                                generation: 0,
                                value: None,
                            })
                        })
                        .collect()
                });
                free.1 += 1;
                i
            }
        };
        drop(free);
        let slot = self.slot(index).expect("allocated above");
        let mut slot = slot.lock().unwrap_or_else(|p| p.into_inner());
        slot.value = Some(value);
        let handle = (self.kind as u64) << KIND_SHIFT
            | slot.generation << SLOT_BITS
            | (u64::from(index) + 1);
        Ok(handle as usize)
    }

    /// Runs `f` on the object of `handle`, holding its slot's lock.
    #[inline]
    pub(crate) fn with<R>(
        &self,
        handle: usize,
        f: impl FnOnce(&mut T) -> CResult<R>,
    ) -> CResult<R> {
        let (index, generation) = self.split(handle)?;
        let mut slot = self.lock(index)?;
        let live = slot.generation;
        match &mut slot.value {
            Some(v) if generation == live => f(v),
            _ if generation < live => Err(self.closed()),
            _ => Err(self.unknown()),
        }
    }

    /// Takes the object of `handle` out; the handle is closed from now on.
    pub(crate) fn remove(&self, handle: usize) -> CResult<T> {
        let (index, generation) = self.split(handle)?;
        let mut slot = self.lock(index)?;
        if generation > slot.generation {
            return Err(self.unknown());
        }
        if generation < slot.generation || slot.value.is_none() {
            return Err(self.closed());
        }
        let value = slot.value.take().expect("checked above");
        // Past the last generation the slot is retired (never freed for reuse): its
        // generation stays above every handle it gave, so they all stay closed.
        slot.generation += 1;
        let retired = slot.generation > LAST_GENERATION;
        drop(slot);
        if !retired {
            self.free
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .0
                .push(index);
        }
        Ok(value)
    }

    /// Locks slot `index` without waiting: another thread's call on it is `SHMB_BUSY`.
    fn lock(&self, index: u32) -> CResult<std::sync::MutexGuard<'_, Slot<T>>> {
        let slot = self.slot(index).ok_or_else(|| self.unknown())?;
        match slot.try_lock() {
            Ok(s) => Ok(s),
            Err(TryLockError::Poisoned(p)) => Ok(p.into_inner()),
            Err(TryLockError::WouldBlock) => Err(Fail::new(
                shmb_status::SHMB_BUSY,
                format!(
                    "this {} is in a call on another thread (calls on one handle must not \
                     overlap; close it once that call returned)",
                    self.what
                ),
            )),
        }
    }

    fn split(&self, handle: usize) -> CResult<(u32, u64)> {
        if handle == 0 {
            return Err(Fail::null(self.what));
        }
        let handle = handle as u64;
        if handle >> KIND_SHIFT != self.kind as u64 {
            return Err(self.unknown());
        }
        let index = (handle & ((1 << SLOT_BITS) - 1)) as u32;
        if index == 0 {
            return Err(self.unknown());
        }
        Ok((index - 1, (handle >> SLOT_BITS) & LAST_GENERATION))
    }

    fn unknown(&self) -> Fail {
        Fail::new(
            shmb_status::SHMB_INVALID_HANDLE,
            format!(
                "not a {} handle this library handed out (a handle of another kind, or a \
                 number it never gave)",
                self.what
            ),
        )
    }

    fn closed(&self) -> Fail {
        Fail::new(
            shmb_status::SHMB_CLOSED,
            format!("this {} handle was closed", self.what),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closed_unknown_and_busy_handles_are_refused() {
        static R: Registry<u32> = Registry::new("thing", Kind::Spec);
        let a = R.insert(7).unwrap();
        assert_eq!(R.with(a, |v| Ok(*v)).unwrap(), 7);
        assert_eq!(R.remove(a).unwrap(), 7);
        assert_eq!(
            R.with(a, |v| Ok(*v)).unwrap_err().status,
            shmb_status::SHMB_CLOSED
        );
        assert_eq!(R.remove(a).unwrap_err().status, shmb_status::SHMB_CLOSED);
        // The slot is reused with a new generation: the old handle stays closed.
        let b = R.insert(8).unwrap();
        assert_ne!(a, b);
        assert_eq!(a & 0xF_FFFF, b & 0xF_FFFF, "same slot");
        assert_eq!(
            R.with(a, |v| Ok(*v)).unwrap_err().status,
            shmb_status::SHMB_CLOSED
        );
        assert_eq!(R.with(b, |v| Ok(*v)).unwrap(), 8);
        let err = |h| R.with(h, |v| Ok(*v)).unwrap_err().status;
        assert_eq!(err(0), shmb_status::SHMB_INVALID_ARGUMENT);
        assert_eq!(
            err(1 << 60),
            shmb_status::SHMB_INVALID_HANDLE,
            "slot 0 is not a slot"
        );
        assert_eq!(err(0xdead_beef), shmb_status::SHMB_INVALID_HANDLE);
        assert_eq!(
            err(b + (5 << 20)),
            shmb_status::SHMB_INVALID_HANDLE,
            "a future generation"
        );
        // A call inside a call on the same handle: busy, not a deadlock.
        let inner = R.with(b, |_| Ok(R.with(b, |v| Ok(*v)).unwrap_err().status));
        assert_eq!(inner.unwrap(), shmb_status::SHMB_BUSY);
        assert_eq!(R.remove(b).unwrap(), 8);
    }

    /// A slot whose generation has gone through every value is never handed out again:
    /// a handle closed long ago must not come back to life (ABA).
    #[test]
    fn a_handle_is_never_handed_out_twice() {
        static R: Registry<u32> = Registry::new("thing", Kind::Spec);
        let first = R.insert(1).unwrap();
        R.remove(first).unwrap();
        let index = (first & 0xF_FFFF) as u32 - 1;
        // As after 2^40 - 1 more closes of this slot.
        R.lock(index).unwrap().generation = LAST_GENERATION;
        let last = R.insert(2).unwrap();
        assert_eq!(R.remove(last).unwrap(), 2);
        let next = R.insert(3).unwrap();
        assert_ne!(next, first, "a closed handle was handed out again");
        assert_ne!(next, last);
        let status = |h| R.with(h, |v| Ok(*v)).unwrap_err().status;
        assert_eq!(status(first), shmb_status::SHMB_CLOSED);
        assert_eq!(status(last), shmb_status::SHMB_CLOSED);
        assert_eq!(R.remove(next).unwrap(), 3);
    }

    #[test]
    fn handles_of_one_kind_are_not_handles_of_another() {
        static SPECS: Registry<u32> = Registry::new("spec", Kind::Spec);
        static CLIENTS: Registry<u32> = Registry::new("client", Kind::Client);
        let s = SPECS.insert(1).unwrap();
        let c = CLIENTS.insert(2).unwrap();
        assert_ne!(s, c, "the first of each kind");
        let status = |f: CResult<u32>| f.unwrap_err().status;
        assert_eq!(
            status(CLIENTS.with(s, |v| Ok(*v))),
            shmb_status::SHMB_INVALID_HANDLE
        );
        assert_eq!(status(SPECS.remove(c)), shmb_status::SHMB_INVALID_HANDLE);
        assert_eq!(SPECS.remove(s).unwrap(), 1);
        assert_eq!(CLIENTS.remove(c).unwrap(), 2);
    }
}
