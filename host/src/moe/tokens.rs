//! The tokens a dispatch sends: bf16 rows, or fp8 rows with a scale per 128 channels.

use super::bf16;
use crate::runtime::launch::LaunchArg;
use crate::runtime::memory::{DeviceBuffer, TrackedPtr};
use crate::{Error, Result};

/// Channels that share one scale in an fp8 row.
///
/// ```
/// use ferrolink::moe::{FP8_SCALE_BLOCK, fp8_row_bytes};
/// // A row of 7168 channels has 56 scales, 4 bytes each, after its 7168 fp8 bytes.
/// assert_eq!(7168 / FP8_SCALE_BLOCK, 56);
/// assert_eq!(fp8_row_bytes(7168), 7168 + 7168 / FP8_SCALE_BLOCK * 4);
/// ```
pub const FP8_SCALE_BLOCK: usize = 128;

/// Bytes of an fp8 token row as a dispatch moves it and as it lies at the start of its row
/// slot in the receive buffer: `hidden` bytes of fp8, then `hidden / 128` `f32` scales.
///
/// ```
/// assert_eq!(ferrolink::moe::fp8_row_bytes(7168), 7168 + 56 * 4);
/// ```
pub const fn fp8_row_bytes(hidden: usize) -> usize {
    hidden + hidden / FP8_SCALE_BLOCK * 4
}

/// The tokens of a dispatch ([`super::Moe::dispatch`], [`super::MoeLowLatency::dispatch`]):
/// `T` rows of `hidden` elements.
///
/// * [`Tokens::Bf16`]: `[T, hidden]` bf16 (what `&DeviceBuffer<bf16>` converts to).
/// * [`Tokens::Fp8`]: `[T, hidden]` one-byte elements (fp8 e4m3 as DeepEP sends them; the
///   dispatch moves bytes and reads none) and `scales`, `[T, hidden / 128]` `f32`, one per
///   128 channels; `hidden` a multiple of 512 (whole 16-byte vectors of scales per row).
///   Each received row slot then starts with the token's [`fp8_row_bytes`]: its `hidden`
///   bytes, then its scales. Half the bytes of bf16 cross the link. The slots stay `2 *
///   hidden` bytes, so the experts write their bf16 results over them as before, and the
///   combine is the same.
///
/// ```
/// # fn main() -> ferrolink::Result<()> {
/// use ferrolink::moe::{MoeConfig, Tokens, fp8_row_bytes};
/// use ferrolink::{Communicator, Device, run_ranks};
/// let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// let comms = Communicator::init_all(&[dev.clone(), dev.clone()])?;
/// let hidden = 512;
/// let cfg = MoeConfig { num_experts: 2, hidden, top_k: 1, max_tokens: 1, capacity: None };
/// let rows = run_ranks(&comms, |c| {
///     let mut moe = c.moe(cfg)?;
///     let dev = c.device();
///     // One token per rank, to expert 0 (on rank 0): bytes all `rank + 1`, scales 0.5.
///     let x = dev.alloc_from(&vec![c.rank() as u8 + 1; hidden])?;
///     let scales = dev.alloc_from(&[0.5f32; 4])?;
///     moe.dispatch(Tokens::fp8(&x, &scales), &dev.alloc_from(&[0i32])?)?;
///     // The receive buffer, in stream order, as bytes.
///     let mut got = dev.alloc(moe.experts_per_rank() * moe.capacity() * hidden)?;
///     moe.copy_received(&mut got)?;
///     Ok(got.to_vec()?.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect::<Vec<u8>>())
/// })?;
/// // Rank 0's expert 0 got rank 0's row in slot 0 and rank 1's in slot 1 (slots of 2 * hidden bytes).
/// let slot = 2 * hidden;
/// assert_eq!(rows[0][slot..slot + hidden], vec![2u8; hidden][..]);
/// let scale = &rows[0][slot + hidden..slot + fp8_row_bytes(hidden)];
/// assert_eq!(f32::from_le_bytes(scale[..4].try_into().unwrap()), 0.5);
/// # Ok(()) }
/// ```
#[derive(Clone, Copy)]
pub enum Tokens<'a> {
    /// `[T, hidden]` bf16.
    Bf16(&'a DeviceBuffer<bf16>),
    /// `[T, hidden]` fp8 bytes and `[T, hidden / 128]` `f32` scales.
    Fp8 {
        /// The rows, one byte per element.
        x: &'a DeviceBuffer<u8>,
        /// One scale per 128 elements of each row.
        scales: &'a DeviceBuffer<f32>,
    },
}

impl<'a> From<&'a DeviceBuffer<bf16>> for Tokens<'a> {
    fn from(x: &'a DeviceBuffer<bf16>) -> Tokens<'a> {
        Tokens::Bf16(x)
    }
}

/// A dispatch's rows: how many, and their 16-byte units of `x` and of scales.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RowShape {
    pub tokens: usize,
    pub x_units: u32,
    pub scale_units: u32,
}

impl<'a> Tokens<'a> {
    /// fp8 rows with their scales.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// use ferrolink::moe::{MoeConfig, Tokens, bf16};
    /// # use ferrolink::{Communicator, Device};
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comm = Communicator::init_all(&[dev.clone()])?.remove(0);
    /// let cfg = MoeConfig { num_experts: 1, hidden: 512, top_k: 1, max_tokens: 2, capacity: None };
    /// let mut moe = comm.moe(cfg)?;
    /// let (x, idx) = (dev.alloc::<u8>(2 * 512)?, dev.alloc_from(&[0i32, 0])?);
    /// // Two rows of 512 channels need 2 x 4 scales (one per 128 channels), not 3.
    /// let few = dev.alloc::<f32>(3)?;
    /// assert!(moe.dispatch(Tokens::fp8(&x, &few), &idx).is_err());
    /// let scales = dev.alloc_from(&[1f32; 8])?;
    /// moe.dispatch(Tokens::fp8(&x, &scales), &idx)?;
    /// # moe.combine(None, &dev.alloc_from(&[1f32; 2])?, &mut dev.alloc::<bf16>(2 * 512)?)?;
    /// # comm.synchronize()?;
    /// # Ok(()) }
    /// ```
    pub fn fp8(x: &'a DeviceBuffer<u8>, scales: &'a DeviceBuffer<f32>) -> Tokens<'a> {
        Tokens::Fp8 { x, scales }
    }

    /// The rows' shape for tokens of `hidden` elements, checked (`call` names the call in
    /// errors).
    pub(crate) fn shape(&self, hidden: usize, call: &str) -> Result<RowShape> {
        let bad = |why: String| Err(Error::InvalidArgument(format!("{call}: {why}")));
        match *self {
            Tokens::Bf16(x) => {
                if !x.len().is_multiple_of(hidden) {
                    return bad(format!("x holds {} elements, not whole rows of {hidden}", x.len()));
                }
                Ok(RowShape { tokens: x.len() / hidden, x_units: (hidden / 8) as u32, scale_units: 0 })
            }
            Tokens::Fp8 { x, scales } => {
                if !hidden.is_multiple_of(4 * FP8_SCALE_BLOCK) {
                    return bad(format!(
                        "fp8 tokens need hidden to be a multiple of {} (whole 16-byte vectors of scales); it is \
                         {hidden}",
                        4 * FP8_SCALE_BLOCK
                    ));
                }
                if !x.len().is_multiple_of(hidden) {
                    return bad(format!("x holds {} bytes, not whole rows of {hidden}", x.len()));
                }
                let tokens = x.len() / hidden;
                let per_row = hidden / FP8_SCALE_BLOCK;
                if scales.len() != tokens * per_row {
                    return bad(format!(
                        "scales hold {} values, {tokens} tokens x {per_row} scales (one per {FP8_SCALE_BLOCK} channels) \
                         = {} needed",
                        scales.len(),
                        tokens * per_row
                    ));
                }
                Ok(RowShape { tokens, x_units: (hidden / 16) as u32, scale_units: (per_row / 4) as u32 })
            }
        }
    }

    /// The rows' device addresses, `(x, scales)` (0: no scales), each added to `reads` as a
    /// tracked read of the launch; only for a shape with tokens.
    pub(crate) fn addresses(&self, reads: &mut Vec<TrackedPtr<'a, *const u8>>) -> Result<(u64, u64)> {
        let (x, scales) = match *self {
            Tokens::Bf16(x) => (x.bytes_at(0)?, None),
            Tokens::Fp8 { x, scales } => (x.bytes_at(0)?, Some(scales.bytes_at(0)?)),
        };
        let addresses = (x.param() as u64, scales.as_ref().map_or(0, |s| s.param() as u64));
        reads.push(x);
        reads.extend(scales);
        Ok(addresses)
    }
}
