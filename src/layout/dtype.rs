//! Element types and their DLPack codes.

/// Element types, with their DLPack codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F16,
    BF16,
    F32,
    F64,
    I8,
    I16,
    I32,
    I64,
    U8,
    U16,
    U32,
    U64,
    /// One byte per element, 0 or 1 (DLPack `kDLBool`, 8 bits).
    Bool,
}

pub const DL_INT: u8 = 0;
pub const DL_UINT: u8 = 1;
pub const DL_FLOAT: u8 = 2;
pub const DL_BFLOAT: u8 = 4;
pub const DL_BOOL: u8 = 6;

impl DType {
    pub const ALL: [DType; 13] = [
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::U16,
        DType::U32,
        DType::U64,
        DType::Bool,
    ];

    /// (DLPack type code, bits).
    pub const fn dlpack(self) -> (u8, u8) {
        match self {
            DType::F16 => (DL_FLOAT, 16),
            DType::BF16 => (DL_BFLOAT, 16),
            DType::F32 => (DL_FLOAT, 32),
            DType::F64 => (DL_FLOAT, 64),
            DType::I8 => (DL_INT, 8),
            DType::I16 => (DL_INT, 16),
            DType::I32 => (DL_INT, 32),
            DType::I64 => (DL_INT, 64),
            DType::U8 => (DL_UINT, 8),
            DType::U16 => (DL_UINT, 16),
            DType::U32 => (DL_UINT, 32),
            DType::U64 => (DL_UINT, 64),
            DType::Bool => (DL_BOOL, 8),
        }
    }

    pub fn from_dlpack(code: u8, bits: u8, lanes: u16) -> Option<DType> {
        if lanes != 1 {
            return None;
        }
        DType::ALL.into_iter().find(|d| d.dlpack() == (code, bits))
    }

    pub const fn size(self) -> usize {
        self.dlpack().1 as usize / 8
    }

    pub const fn name(self) -> &'static str {
        match self {
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::I8 => "i8",
            DType::I16 => "i16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
            DType::U16 => "u16",
            DType::U32 => "u32",
            DType::U64 => "u64",
            DType::Bool => "bool",
        }
    }

    pub fn parse(s: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == s)
    }

    /// The NumPy-style name (what `numpy.dtype(name)` and torch understand).
    pub const fn array_name(self) -> &'static str {
        match self {
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::U8 => "uint8",
            DType::U16 => "uint16",
            DType::U32 => "uint32",
            DType::U64 => "uint64",
            DType::Bool => "bool",
        }
    }

    /// A dtype by its short name (`f32`) or its NumPy-style one (`float32`).
    pub fn parse_any(s: &str) -> Option<DType> {
        DType::parse(s).or_else(|| DType::ALL.into_iter().find(|d| d.array_name() == s))
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
