//! Symmetric memory windows as kernels see them.
//!
//! A window is one buffer per rank, registered collectively. Every rank of an LSA domain
//! maps every peer's buffer into one flat virtual range, slot `p` at `flat_base + p * stride`,
//! so a peer's copy of offset `o` is one add away ([`DevWindow::lsa_ptr`], NCCL's
//! `ncclGetLsaPointer`). Loads and stores through these pointers are plain memory accesses
//! over NVLink (or within the GPU); order them with barriers or release/acquire atomics.

use bytemuck::{Pod, Zeroable};
use core::marker::PhantomData;

/// A registered window as a kernel argument (by value, `#[repr(C)]`).
///
/// ```
/// use ferrolink_device::DevWindow;
/// // What rank 1 of an LSA domain of 4 gets for a 4 KiB window (slots 2 MiB apart).
/// let win = DevWindow { flat_base: 0x7000_0000, stride: 0x20_0000, size: 4096, lsa_rank: 1, lsa_size: 4, id: 0, _reserved: 0 };
/// // Peer p's buffer is slot p of the flat range; this rank's own is slot `lsa_rank`.
/// assert_eq!(win.lsa_ptr::<u8>(0, 3) as u64, 0x7000_0000 + 3 * 0x20_0000);
/// assert_eq!(win.local_ptr::<u8>(0), win.lsa_ptr(0, 1));
/// ```
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct DevWindow {
    /// Device address of LSA rank 0's slot in this GPU's flat mapping.
    pub flat_base: u64,
    /// Bytes between consecutive ranks' slots (the buffer size rounded up to the mapping
    /// granularity).
    pub stride: u64,
    /// Usable bytes per rank.
    pub size: u64,
    /// This rank's LSA rank (its own slot).
    pub lsa_rank: u32,
    /// Ranks mapped.
    pub lsa_size: u32,
    /// The window's number in its communicator, the same on every rank: how GIN names a
    /// window on the wire (never by address).
    pub id: u32,
    /// Padding.
    pub _reserved: u32,
}

impl DevWindow {
    /// Address of byte `offset` in LSA peer `peer`'s buffer. No bounds check: see
    /// [`DevWindow::lsa_ptr_checked`].
    ///
    /// ```
    /// # use ferrolink_device::DevWindow;
    /// // What a rank of an LSA domain of 4 gets for a 4 KiB window (2 MiB slots).
    /// let win = DevWindow { flat_base: 0x7000_0000, stride: 0x20_0000, size: 4096, lsa_rank: 1, lsa_size: 4, ..Default::default() };
    /// // Word 2 of peer 3's buffer:
    /// let p: *mut u32 = win.lsa_ptr(8, 3);
    /// assert_eq!(p as u64, 0x7000_0000 + 3 * 0x20_0000 + 8);
    /// ```
    #[inline(always)]
    pub fn lsa_ptr<T>(&self, offset: usize, peer: u32) -> *mut T {
        (self.flat_base + peer as u64 * self.stride + offset as u64) as *mut T
    }

    /// Address of byte `offset` in this rank's own buffer.
    ///
    /// ```
    /// # use ferrolink_device::DevWindow;
    /// # // What a rank of an LSA domain of 4 gets for a 4 KiB window (2 MiB slots).
    /// # let win = DevWindow { flat_base: 0x7000_0000, stride: 0x20_0000, size: 4096, lsa_rank: 1, lsa_size: 4, ..Default::default() };
    /// let mine: *mut u32 = win.local_ptr(8);
    /// assert_eq!(mine, win.lsa_ptr(8, win.lsa_rank));
    /// ```
    #[inline(always)]
    pub fn local_ptr<T>(&self, offset: usize) -> *mut T {
        self.lsa_ptr(offset, self.lsa_rank)
    }

    /// [`DevWindow::lsa_ptr`] if `peer < lsa_size` and `size_of::<T>()` bytes at `offset`
    /// fit in the buffer, else `None`.
    ///
    /// ```
    /// # use ferrolink_device::DevWindow;
    /// // What a rank of an LSA domain of 4 gets for a 4 KiB window (2 MiB slots).
    /// let win = DevWindow { flat_base: 0x7000_0000, stride: 0x20_0000, size: 4096, lsa_rank: 1, lsa_size: 4, ..Default::default() };
    /// assert_eq!(win.lsa_ptr_checked::<u32>(4092, 3), Some(win.lsa_ptr(4092, 3)));
    /// assert_eq!(win.lsa_ptr_checked::<u32>(4093, 3), None); // past the buffer
    /// assert_eq!(win.lsa_ptr_checked::<u32>(0, 4), None); // no such peer
    /// ```
    #[inline(always)]
    pub fn lsa_ptr_checked<T>(&self, offset: usize, peer: u32) -> Option<*mut T> {
        let end = offset.checked_add(core::mem::size_of::<T>())?;
        (peer < self.lsa_size && end as u64 <= self.size).then(|| self.lsa_ptr(offset, peer))
    }

    /// A typed symmetric pointer to element `index` of `T`s in this window.
    ///
    /// ```
    /// # use ferrolink_device::DevWindow;
    /// # // What a rank of an LSA domain of 4 gets for a 4 KiB window (2 MiB slots).
    /// # let win = DevWindow { flat_base: 0x7000_0000, stride: 0x20_0000, size: 4096, lsa_rank: 1, lsa_size: 4, ..Default::default() };
    /// // Element 3 of u64s: byte 24 of every rank's buffer.
    /// let x = win.sym::<u64>(3);
    /// assert_eq!(x.lsa(2), win.lsa_ptr(24, 2));
    /// ```
    #[inline(always)]
    pub fn sym<T>(&self, index: usize) -> SymPtr<T> {
        SymPtr { window: *self, offset: (index * core::mem::size_of::<T>()) as u64, _t: PhantomData }
    }
}

/// A typed pointer into a window that names the same element on every rank (NCCL's
/// `ncclSymPtr<T>`): resolve it for a peer with [`SymPtr::lsa`] or locally with
/// [`SymPtr::local`].
///
/// ```
/// # use ferrolink_device::DevWindow;
/// // What a rank of an LSA domain of 4 gets for a 4 KiB window (2 MiB slots).
/// let win = DevWindow { flat_base: 0x7000_0000, stride: 0x20_0000, size: 4096, lsa_rank: 1, lsa_size: 4, ..Default::default() };
/// // Word `me` of the window, named once for every rank's buffer.
/// let mine = win.sym::<u32>(0).offset_by(win.lsa_rank as usize);
/// assert_eq!(mine.lsa(3), win.lsa_ptr(4, 3));
/// assert_eq!(mine.local(), win.local_ptr(4));
/// ```
#[derive(Clone, Copy, Debug)]
pub struct SymPtr<T> {
    window: DevWindow,
    offset: u64,
    _t: PhantomData<*mut T>,
}

impl<T> SymPtr<T> {
    /// This element in LSA peer `peer`'s buffer.
    ///
    /// ```
    /// # use ferrolink_device::DevWindow;
    /// # // What a rank of an LSA domain of 4 gets for a 4 KiB window (2 MiB slots).
    /// # let win = DevWindow { flat_base: 0x7000_0000, stride: 0x20_0000, size: 4096, lsa_rank: 1, lsa_size: 4, ..Default::default() };
    /// let x = win.sym::<f32>(10);
    /// assert_eq!(x.lsa(0), win.lsa_ptr(40, 0));
    /// ```
    #[inline(always)]
    pub fn lsa(&self, peer: u32) -> *mut T {
        self.window.lsa_ptr(self.offset as usize, peer)
    }

    /// This element in this rank's own buffer.
    ///
    /// ```
    /// # use ferrolink_device::DevWindow;
    /// # // What a rank of an LSA domain of 4 gets for a 4 KiB window (2 MiB slots).
    /// # let win = DevWindow { flat_base: 0x7000_0000, stride: 0x20_0000, size: 4096, lsa_rank: 1, lsa_size: 4, ..Default::default() };
    /// let x = win.sym::<f32>(10);
    /// assert_eq!(x.local(), x.lsa(win.lsa_rank));
    /// ```
    #[inline(always)]
    pub fn local(&self) -> *mut T {
        self.window.local_ptr(self.offset as usize)
    }

    /// The pointer `n` elements further.
    ///
    /// ```
    /// # use ferrolink_device::DevWindow;
    /// # // What a rank of an LSA domain of 4 gets for a 4 KiB window (2 MiB slots).
    /// # let win = DevWindow { flat_base: 0x7000_0000, stride: 0x20_0000, size: 4096, lsa_rank: 1, lsa_size: 4, ..Default::default() };
    /// // Element 2, then 5 further: element 7 (byte 28).
    /// let x = win.sym::<u32>(2).offset_by(5);
    /// assert_eq!(x.local(), win.local_ptr(28));
    /// ```
    #[inline(always)]
    pub fn offset_by(self, n: usize) -> SymPtr<T> {
        SymPtr { offset: self.offset + (n * core::mem::size_of::<T>()) as u64, ..self }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lsa_pointers_follow_the_flat_layout() {
        let w = DevWindow {
            flat_base: 0x1000_0000,
            stride: 0x20_0000,
            size: 1000,
            lsa_rank: 2,
            lsa_size: 4,
            ..Default::default()
        };
        assert_eq!(w.lsa_ptr::<u8>(8, 3) as u64, 0x1000_0000 + 3 * 0x20_0000 + 8);
        assert_eq!(w.local_ptr::<u8>(0) as u64, 0x1000_0000 + 2 * 0x20_0000);
        assert_eq!(w.lsa_ptr_checked::<u32>(996, 1).map(|p| p as u64), Some(0x1000_0000 + 0x20_0000 + 996));
        assert!(w.lsa_ptr_checked::<u32>(997, 1).is_none());
        assert!(w.lsa_ptr_checked::<u32>(0, 4).is_none());
        assert!(w.lsa_ptr_checked::<u32>(usize::MAX, 0).is_none());
        let s = w.sym::<u64>(3).offset_by(2);
        assert_eq!(s.lsa(1) as u64, 0x1000_0000 + 0x20_0000 + 40);
        assert_eq!(s.local() as u64, 0x1000_0000 + 2 * 0x20_0000 + 40);
    }
}
