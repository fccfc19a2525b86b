//! Checking an array offered as actions against the engine's action tensor, and the host
//! copy into it.
//!
//! The caller describes the array with plain values (what DLPack, NumPy's array
//! interface or a C caller already has: element type, shape, byte strides, data pointer,
//! device), so that no binding needs a check of its own: the Python binding's
//! `step(actions)` uses this one. The C ABI has no such call (a C client writes
//! the action tensor in place, through `shmb_client_tensor`), so nothing there checks
//! offered arrays. The checks never copy; the copy checks first, so nothing is written on
//! error.

use crate::layout::DType;

/// Where an array's bytes are: a DLPack device type and id (1 = CPU, 2 = CUDA, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArrayDevice {
    pub kind: u32,
    pub id: i32,
}

impl ArrayDevice {
    pub const CPU: ArrayDevice = ArrayDevice { kind: 1, id: 0 };

    pub const fn cuda(ordinal: i32) -> ArrayDevice {
        ArrayDevice {
            kind: 2,
            id: ordinal,
        }
    }

    pub fn is_cpu(self) -> bool {
        self.kind == Self::CPU.kind
    }
}

/// An element type as DLPack spells it (type code, bits, lanes): an offered array may
/// have one no [`DType`] matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ElementType {
    pub code: u8,
    pub bits: u8,
    pub lanes: u16,
}

impl From<DType> for ElementType {
    fn from(d: DType) -> Self {
        let (code, bits) = d.dlpack();
        ElementType {
            code,
            bits,
            lanes: 1,
        }
    }
}

impl std::fmt::Display for ElementType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match DType::from_dlpack(self.code, self.bits, self.lanes) {
            Some(d) => f.write_str(array_dtype_name(d)),
            None => write!(
                f,
                "code {} bits {} lanes {}",
                self.code, self.bits, self.lanes
            ),
        }
    }
}

/// The NumPy-style name of a dtype (what `numpy.dtype(name)` and torch understand, and
/// what the messages about offered arrays say).
pub const fn array_dtype_name(d: DType) -> &'static str {
    d.array_name()
}

/// The action tensor, as this process sees it.
#[derive(Debug, Clone, Copy)]
pub struct ActionSlot<'a> {
    pub dtype: DType,
    pub shape: &'a [u64],
    /// Where its bytes are in this process (host memory of the region, or the engine's
    /// device allocation opened here).
    pub device: ArrayDevice,
}

impl ActionSlot<'_> {
    /// The bytes of the slot (saturating: a layout's shapes are validated to fit).
    pub fn nbytes(&self) -> usize {
        self.shape
            .iter()
            .fold(self.dtype.size(), |n, &d| n.saturating_mul(d as usize))
    }
}

/// An array offered as actions.
#[derive(Debug, Clone, Copy)]
pub struct ArrayDesc<'a> {
    pub dtype: ElementType,
    pub shape: &'a [i64],
    /// Bytes between neighbours along each axis; `None` for C-contiguous.
    pub byte_strides: Option<&'a [i64]>,
    pub device: ArrayDevice,
}

impl ArrayDesc<'_> {
    /// Whether the elements are laid out C-contiguously: strides of axes of extent 1
    /// (and of an empty array) do not matter, as NumPy counts it.
    pub fn is_c_contiguous(&self) -> bool {
        let Some(strides) = self.byte_strides else {
            return true;
        };
        if strides.len() != self.shape.len() || self.shape.contains(&0) {
            return strides.len() == self.shape.len();
        }
        let mut expected = i64::from(self.dtype.bits / 8) * i64::from(self.dtype.lanes);
        for (&extent, &stride) in self.shape.iter().zip(strides).rev() {
            if extent != 1 && stride != expected {
                return false;
            }
            match expected.checked_mul(extent) {
                Some(next) => expected = next,
                None => return false,
            }
        }
        true
    }
}

/// Byte strides from strides counted in elements (DLPack's unit), or `Strides` if one
/// overflows.
pub fn byte_strides(element_strides: &[i64], dtype: ElementType) -> Result<Vec<i64>, ActionError> {
    let itemsize = i64::from(dtype.bits / 8) * i64::from(dtype.lanes);
    element_strides
        .iter()
        .map(|&s| {
            s.checked_mul(itemsize)
                .ok_or(ActionError::Strides("a stride overflows"))
        })
        .collect()
}

/// Why an array cannot be the actions. The messages are what the user reads; the Python
/// binding raises [`ActionError::is_type_error`] ones as `TypeError`, the others as
/// `ValueError`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ActionError {
    #[error("actions have dtype {got}, the engine expects {}", array_dtype_name(*.expected))]
    DType { got: ElementType, expected: DType },

    #[error("actions have shape {got:?}, the engine expects {expected:?}")]
    Shape { got: Vec<i64>, expected: Vec<u64> },

    #[error(
        "actions are on device {}:{}, but the engine's 'actions' live in host memory: pass \
         a CPU array (no implicit device-to-host copy)",
        .got.kind, .got.id
    )]
    NotOnHost { got: ArrayDevice },

    #[error(
        "actions are on device {}:{}, but the engine's 'actions' live on cuda:{ordinal} \
         (DLPack device 2:{ordinal}): move them there first (no implicit transfer)",
        .got.kind, .got.id
    )]
    WrongDevice { got: ArrayDevice, ordinal: i32 },

    #[error("CUDA actions must be C-contiguous (call .contiguous() first)")]
    NotContiguous,

    #[error("invalid DLPack strides: {0}")]
    Strides(&'static str),
}

impl ActionError {
    /// A wrong element type (Python's `TypeError`); the rest are wrong values.
    pub fn is_type_error(&self) -> bool {
        matches!(self, ActionError::DType { .. })
    }
}

/// That arrays on `device` may be copied into `slot`: host arrays into a host slot, and
/// for a device slot, arrays on that same device (no implicit transfers).
pub fn check_device(slot: &ActionSlot<'_>, device: ArrayDevice) -> Result<(), ActionError> {
    if device == slot.device {
        return Ok(());
    }
    if slot.device.is_cpu() {
        Err(ActionError::NotOnHost { got: device })
    } else {
        Err(ActionError::WrongDevice {
            got: device,
            ordinal: slot.device.id,
        })
    }
}

/// Every check of `array` against `slot`, in the order the user is told: device, dtype,
/// shape, and for a device slot C-contiguity (its copy is one device-to-device copy).
/// A host slot takes any strides ([`copy_to_host_slot`]), which must be consistent.
pub fn check(slot: &ActionSlot<'_>, array: &ArrayDesc<'_>) -> Result<(), ActionError> {
    check_device(slot, array.device)?;
    if array.dtype != ElementType::from(slot.dtype) {
        return Err(ActionError::DType {
            got: array.dtype,
            expected: slot.dtype,
        });
    }
    let same_shape = array.shape.len() == slot.shape.len()
        && array
            .shape
            .iter()
            .zip(slot.shape)
            .all(|(&a, &s)| u64::try_from(a) == Ok(s));
    if !same_shape {
        return Err(ActionError::Shape {
            got: array.shape.to_vec(),
            expected: slot.shape.to_vec(),
        });
    }
    if let Some(strides) = array.byte_strides {
        if strides.len() != array.shape.len() {
            return Err(ActionError::Strides("one stride per axis"));
        }
    }
    if !slot.device.is_cpu() && !array.is_c_contiguous() {
        return Err(ActionError::NotContiguous);
    }
    Ok(())
}

/// That every element offset of an array of `shape` and byte `strides` fits an `isize`:
/// the farthest one from the first element, `sum((n - 1) * |stride|)`, bounds them all.
fn check_offsets_fit(shape: &[i64], strides: &[i64]) -> Result<(), ActionError> {
    let overflow = ActionError::Strides("an element's offset overflows");
    let mut reach = 0i64;
    for (&n, &s) in shape.iter().zip(strides) {
        let far = (n.max(1) - 1)
            .checked_mul(s.checked_abs().ok_or(overflow.clone())?)
            .ok_or(overflow.clone())?;
        reach = reach.checked_add(far).ok_or(overflow.clone())?;
    }
    isize::try_from(reach).map(|_| ()).map_err(|_| overflow)
}

/// The byte offset from the first element of each element of an array, in C order.
/// Call [`check_offsets_fit`] first: no partial sum then overflows.
fn element_offsets<'a>(shape: &'a [i64], strides: &'a [i64]) -> impl Iterator<Item = isize> + 'a {
    let numel: i64 = shape.iter().product();
    let mut index = vec![0i64; shape.len()];
    (0..numel).map(move |_| {
        let offset: i64 = index.iter().zip(strides).map(|(&i, &s)| i * s).sum();
        for d in (0..shape.len()).rev() {
            index[d] += 1;
            if index[d] < shape[d] {
                break;
            }
            index[d] = 0;
        }
        offset as isize
    })
}

/// Checks `array` against the host `slot` ([`check`]) and copies its elements, in C
/// order, to `dst`: one `memmove` for a C-contiguous array, else element by element
/// (a transposed or sliced view). Nothing is written on error.
///
/// # Safety
/// - `src` points at the first element of `array` (any byte offset applied), and every
///   element its shape and strides address is readable for the whole call;
/// - `dst` is valid for writes of `slot.nbytes()` bytes, and no other thread writes the
///   source or the destination during the call (they may overlap: the array may be a
///   view of the slot itself).
pub unsafe fn copy_to_host_slot(
    slot: &ActionSlot<'_>,
    array: &ArrayDesc<'_>,
    src: *const u8,
    dst: *mut u8,
) -> Result<(), ActionError> {
    check(slot, array)?;
    if !slot.device.is_cpu() {
        // `check` accepted an array on the slot's device: not host bytes to copy here.
        return Err(ActionError::NotOnHost { got: slot.device });
    }
    let nbytes = slot.nbytes();
    let strides = match array.byte_strides {
        Some(s) if !array.is_c_contiguous() => s,
        _ => {
            // SAFETY: same dtype and shape as the slot, C-contiguous: the source is
            // `nbytes` readable bytes and the destination `nbytes` writable ones (the
            // caller's contract); `copy` is a memmove, correct for overlapping ranges.
            unsafe { std::ptr::copy(src, dst, nbytes) };
            return Ok(());
        }
    };
    check_offsets_fit(array.shape, strides)?;
    // Gathered first: a strided view of the slot itself (which the copy would overwrite
    // as it reads) is then copied correctly.
    let itemsize = slot.dtype.size();
    let mut gathered = vec![0u8; nbytes];
    for (element, offset) in gathered
        .chunks_exact_mut(itemsize)
        .zip(element_offsets(array.shape, strides))
    {
        // SAFETY: `offset` is the byte offset of an element the array's shape and strides
        // address, readable by the caller's contract; `element` is `itemsize` bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(src.offset(offset), element.as_mut_ptr(), itemsize)
        };
    }
    // SAFETY: `dst` is valid for `nbytes` writes (the caller's contract); `gathered` is a
    // buffer of ours, so the ranges do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(gathered.as_ptr(), dst, nbytes) };
    Ok(())
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn host_slot(dtype: DType, shape: &[u64]) -> ActionSlot<'_> {
        ActionSlot {
            dtype,
            shape,
            device: ArrayDevice::CPU,
        }
    }

    fn array<'a>(dtype: DType, shape: &'a [i64], strides: Option<&'a [i64]>) -> ArrayDesc<'a> {
        ArrayDesc {
            dtype: dtype.into(),
            shape,
            byte_strides: strides,
            device: ArrayDevice::CPU,
        }
    }

    /// [`copy_to_host_slot`] from `src` into `out`.
    ///
    /// # Safety
    /// As for [`copy_to_host_slot`]'s source; `out` holds the slot's bytes.
    unsafe fn copy_into<T>(
        slot: &ActionSlot<'_>,
        view: &ArrayDesc<'_>,
        src: *const T,
        out: &mut [T],
    ) -> Result<(), ActionError> {
        assert_eq!(std::mem::size_of_val(out), slot.nbytes());
        // SAFETY: `out` is valid for the slot's bytes (asserted); the source is the
        // caller's contract.
        unsafe { copy_to_host_slot(slot, view, src.cast(), out.as_mut_ptr().cast()) }
    }

    #[test]
    fn wrong_dtype_is_a_type_error_named_as_numpy_names_it() {
        let slot = host_slot(DType::F32, &[4, 3]);
        let e = check(&slot, &array(DType::F64, &[4, 3], None)).unwrap_err();
        assert!(e.is_type_error());
        assert_eq!(
            e.to_string(),
            "actions have dtype float64, the engine expects float32"
        );
        let odd = ArrayDesc {
            dtype: ElementType {
                code: 5,
                bits: 64,
                lanes: 1,
            },
            ..array(DType::F32, &[4, 3], None)
        };
        assert_eq!(
            check(&slot, &odd).unwrap_err().to_string(),
            "actions have dtype code 5 bits 64 lanes 1, the engine expects float32"
        );
    }

    #[test]
    fn wrong_shape_is_a_value_error() {
        let slot = host_slot(DType::I64, &[4, 1]);
        for shape in [&[4, 2][..], &[4], &[4, 1, 1], &[-4, 1]] {
            let e = check(&slot, &array(DType::I64, shape, None)).unwrap_err();
            assert!(!e.is_type_error());
            assert_eq!(
                e.to_string(),
                format!("actions have shape {shape:?}, the engine expects [4, 1]")
            );
        }
    }

    #[test]
    fn device_mismatches_name_both_devices() {
        let host = host_slot(DType::F32, &[2]);
        let on_gpu = ArrayDesc {
            device: ArrayDevice::cuda(1),
            ..array(DType::F32, &[2], None)
        };
        assert_eq!(
            check(&host, &on_gpu).unwrap_err().to_string(),
            "actions are on device 2:1, but the engine's 'actions' live in host memory: pass \
             a CPU array (no implicit device-to-host copy)"
        );
        let cuda = ActionSlot {
            device: ArrayDevice::cuda(0),
            ..host
        };
        let e = check(&cuda, &array(DType::F32, &[2], None)).unwrap_err();
        assert_eq!(
            e,
            ActionError::WrongDevice {
                got: ArrayDevice::CPU,
                ordinal: 0
            }
        );
        assert!(e.to_string().contains("live on cuda:0"));
        assert!(e.to_string().starts_with("actions are on device 1:0"));
    }

    #[test]
    fn a_device_slot_takes_only_c_contiguous_arrays() {
        let cuda = ActionSlot {
            dtype: DType::F32,
            shape: &[16, 3],
            device: ArrayDevice::cuda(0),
        };
        let on = |strides| ArrayDesc {
            device: ArrayDevice::cuda(0),
            ..array(DType::F32, &[16, 3], strides)
        };
        assert_eq!(check(&cuda, &on(None)), Ok(()));
        assert_eq!(check(&cuda, &on(Some(&[12, 4]))), Ok(()));
        assert_eq!(
            check(&cuda, &on(Some(&[4, 64]))),
            Err(ActionError::NotContiguous)
        );
        // A host slot takes the transposed view (it is copied element by element).
        let host = host_slot(DType::F32, &[16, 3]);
        assert_eq!(
            check(&host, &array(DType::F32, &[16, 3], Some(&[4, 64]))),
            Ok(())
        );
    }

    #[test]
    fn contiguity_ignores_axes_of_extent_one_and_empty_arrays() {
        assert!(array(DType::F32, &[1, 3], Some(&[999, 4])).is_c_contiguous());
        assert!(array(DType::F32, &[0, 3], Some(&[7, 7])).is_c_contiguous());
        assert!(array(DType::F32, &[], Some(&[])).is_c_contiguous());
        assert!(!array(DType::F32, &[2, 3], Some(&[4, 8])).is_c_contiguous());
        assert!(!array(DType::F32, &[2, 3], Some(&[12])).is_c_contiguous());
    }

    #[test]
    fn element_strides_become_byte_strides() {
        let f32 = ElementType::from(DType::F32);
        assert_eq!(byte_strides(&[3, 1], f32), Ok(vec![12, 4]));
        assert_eq!(byte_strides(&[-1], f32), Ok(vec![-4]));
        assert!(byte_strides(&[i64::MAX / 2], f32).is_err());
    }

    #[test]
    fn strided_copy_of_a_transposed_view() {
        // Source: a 3x2 i32 array; offered: its transpose, a 2x3 view.
        let source: [i32; 6] = [1, 2, 3, 4, 5, 6];
        let slot = host_slot(DType::I32, &[2, 3]);
        let view = array(DType::I32, &[2, 3], Some(&[4, 8]));
        let mut out = [0i32; 6];
        // SAFETY: the view addresses elements 0..6 of `source`; `out` holds 6 elements.
        unsafe { copy_into(&slot, &view, source.as_ptr(), &mut out) }.unwrap();
        assert_eq!(out, [1, 3, 5, 2, 4, 6]);
    }

    #[test]
    fn negative_strides_and_broadcast_zero_strides_are_copied() {
        let source: [u16; 4] = [10, 20, 30, 40];
        let slot = host_slot(DType::U16, &[4]);
        let reversed = array(DType::U16, &[4], Some(&[-2]));
        let mut out = [0u16; 4];
        // SAFETY: from the last element backwards, the view addresses the 4 elements.
        unsafe { copy_into(&slot, &reversed, source.as_ptr().add(3), &mut out) }.unwrap();
        assert_eq!(out, [40, 30, 20, 10]);
        let broadcast = array(DType::U16, &[4], Some(&[0]));
        // SAFETY: a zero stride addresses element 0 only.
        unsafe { copy_into(&slot, &broadcast, source.as_ptr(), &mut out) }.unwrap();
        assert_eq!(out, [10; 4]);
    }

    #[test]
    fn rejected_arrays_write_nothing() {
        let source = [7u8; 8];
        let mut out = [0u8; 8];
        let slot = host_slot(DType::U8, &[8]);
        let cases = [
            array(DType::I8, &[8], None),
            array(DType::U8, &[4, 2], None),
            array(DType::U8, &[8], Some(&[1, 1])),
            array(DType::U8, &[8], Some(&[i64::MAX])),
        ];
        for bad in cases {
            // SAFETY: every case is rejected before any byte is read.
            let r = unsafe { copy_to_host_slot(&slot, &bad, source.as_ptr(), out.as_mut_ptr()) };
            assert!(r.is_err(), "{bad:?}");
            assert_eq!(out, [0; 8]);
        }
    }

    #[test]
    fn a_device_slot_is_not_copied_on_the_host() {
        let slot = ActionSlot {
            dtype: DType::U8,
            shape: &[2],
            device: ArrayDevice::cuda(0),
        };
        let a = ArrayDesc {
            device: ArrayDevice::cuda(0),
            ..array(DType::U8, &[2], None)
        };
        let mut out = [0u8; 2];
        // SAFETY: refused before any access.
        let r = unsafe { copy_to_host_slot(&slot, &a, [1u8, 2].as_ptr(), out.as_mut_ptr()) };
        assert!(matches!(r, Err(ActionError::NotOnHost { .. })));
    }

    /// A random 1–3-d array as a permuted, possibly reversed and stepped view of a
    /// C-contiguous buffer, and the elements that view holds in C order.
    fn strided_view() -> impl Strategy<Value = (Vec<i64>, Vec<i64>, usize, Vec<u32>, Vec<u32>)> {
        (1usize..4)
            .prop_flat_map(|ndim| {
                (
                    prop::collection::vec(1i64..5, ndim),
                    prop::collection::vec(1i64..3, ndim),
                    prop::collection::vec(any::<bool>(), ndim),
                    Just((0..ndim).collect::<Vec<_>>()).prop_shuffle(),
                )
            })
            .prop_map(|(shape, steps, flips, perm)| {
                // The buffer: C-contiguous over the view's shape times the steps.
                let base: Vec<i64> = shape.iter().zip(&steps).map(|(n, s)| n * s).collect();
                let total: i64 = base.iter().product();
                let buffer: Vec<u32> = (0..total as u32).collect();
                let mut base_strides = vec![1i64; base.len()];
                for d in (0..base.len().saturating_sub(1)).rev() {
                    base_strides[d] = base_strides[d + 1] * base[d + 1];
                }
                // Axis a of the view walks buffer axis perm[a] by steps[perm[a]] elements,
                // backwards when flipped.
                let mut start = 0i64;
                let mut strides = Vec::new();
                let mut shape_v = Vec::new();
                for &b in &perm {
                    let stride = base_strides[b] * steps[b];
                    if flips[b] {
                        start += (shape[b] - 1) * stride;
                        strides.push(-stride * 4);
                    } else {
                        strides.push(stride * 4);
                    }
                    shape_v.push(shape[b]);
                }
                // The expected elements, walked in C order of the view.
                let mut expected = Vec::new();
                let numel: i64 = shape_v.iter().product();
                let mut index = vec![0i64; shape_v.len()];
                for _ in 0..numel {
                    let off: i64 = index.iter().zip(&strides).map(|(i, s)| i * s / 4).sum();
                    expected.push(buffer[(start + off) as usize]);
                    for d in (0..shape_v.len()).rev() {
                        index[d] += 1;
                        if index[d] < shape_v[d] {
                            break;
                        }
                        index[d] = 0;
                    }
                }
                (shape_v, strides, start as usize, buffer, expected)
            })
    }

    proptest! {
        #[test]
        fn strided_copies_match_an_index_walk((shape, strides, start, buffer, expected) in strided_view()) {
            let slot_shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
            let slot = host_slot(DType::U32, &slot_shape);
            let view = array(DType::U32, &shape, Some(&strides));
            let mut out = vec![0u32; expected.len()];
            // SAFETY: `start` and the strides address elements of `buffer` only (built so
            // by `strided_view`); `out` holds the view's element count.
            unsafe {
                copy_into(&slot, &view, buffer.as_ptr().add(start), &mut out)
            }.unwrap();
            prop_assert_eq!(out, expected);
        }

        #[test]
        fn c_contiguity_agrees_with_the_compact_strides(shape in prop::collection::vec(0i64..4, 0..4)) {
            let mut strides = vec![0i64; shape.len()];
            let mut acc = 8i64;
            for d in (0..shape.len()).rev() {
                strides[d] = acc;
                acc *= shape[d];
            }
            prop_assert!(array(DType::F64, &shape, Some(&strides)).is_c_contiguous());
            prop_assert!(array(DType::F64, &shape, None).is_c_contiguous());
        }
    }
}
