//! Handles: what C holds instead of pointers to Rust objects.
//!
//! A handle is a number, `(generation << 32) | (slot + 1)`, typed in C as a pointer to
//! an opaque struct and never dereferenced. Each slot of a [`Registry`] holds one object
//! behind a mutex with the generation it was handed out under; closing takes the object
//! out and bumps the generation. So a call with a closed handle finds an older
//! generation (`SHMB_CLOSED`), a number this library never handed out finds no slot or
//! a newer generation (`SHMB_INVALID_HANDLE`), NULL is `SHMB_INVALID_ARGUMENT`, and two
//! threads in calls on one handle get `SHMB_BUSY` rather than a data race: none of them
//! can reach freed memory. Slots are reused (with a new generation), so memory stays
//! bounded however many engines and clients come and go.

use std::sync::{Mutex, OnceLock, TryLockError};

use crate::status::{shmb_status, CResult, Fail};

const CHUNK: usize = 256;
const CHUNKS: usize = 256;

struct Slot<T> {
    generation: u32,
    value: Option<T>,
}

/// A lazily allocated block of `CHUNK` slots.
type Chunk<T> = OnceLock<Box<[Mutex<Slot<T>>]>>;

/// One kind of handle's objects.
pub(crate) struct Registry<T> {
    what: &'static str,
    chunks: [Chunk<T>; CHUNKS],
    /// Free slots and the number of slots ever used (create and close only).
    free: Mutex<(Vec<u32>, u32)>,
}

impl<T> Registry<T> {
    pub(crate) const fn new(what: &'static str) -> Self {
        Registry {
            what,
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
        Ok(((slot.generation as usize) << 32) | (index as usize + 1))
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
        slot.generation = slot.generation.wrapping_add(1);
        drop(slot);
        self.free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .0
            .push(index);
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

    fn split(&self, handle: usize) -> CResult<(u32, u32)> {
        if handle == 0 {
            return Err(Fail::null(self.what));
        }
        let index = (handle & 0xFFFF_FFFF) as u32;
        if index == 0 {
            return Err(self.unknown());
        }
        Ok((index - 1, (handle as u64 >> 32) as u32))
    }

    fn unknown(&self) -> Fail {
        Fail::new(
            shmb_status::SHMB_INVALID_HANDLE,
            format!("not a {} handle this library handed out", self.what),
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
        static R: Registry<u32> = Registry::new("thing");
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
        assert_eq!(a & 0xFFFF_FFFF, b & 0xFFFF_FFFF, "same slot");
        assert_eq!(
            R.with(a, |v| Ok(*v)).unwrap_err().status,
            shmb_status::SHMB_CLOSED
        );
        assert_eq!(R.with(b, |v| Ok(*v)).unwrap(), 8);
        let err = |h| R.with(h, |v| Ok(*v)).unwrap_err().status;
        assert_eq!(err(0), shmb_status::SHMB_INVALID_ARGUMENT);
        assert_eq!(
            err(1 << 32),
            shmb_status::SHMB_INVALID_HANDLE,
            "slot 0 is not a slot"
        );
        assert_eq!(err(0xdead_beef), shmb_status::SHMB_INVALID_HANDLE);
        assert_eq!(
            err(b + (5 << 32)),
            shmb_status::SHMB_INVALID_HANDLE,
            "a future generation"
        );
        // A call inside a call on the same handle: busy, not a deadlock.
        let inner = R.with(b, |_| Ok(R.with(b, |v| Ok(*v)).unwrap_err().status));
        assert_eq!(inner.unwrap(), shmb_status::SHMB_BUSY);
        assert_eq!(R.remove(b).unwrap(), 8);
    }
}
