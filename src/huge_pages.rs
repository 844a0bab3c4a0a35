//! Which memory the model keeps on 2 MiB pages, and how it gets there (Linux; elsewhere these
//! calls do nothing).
//!
//! - **Weights, after loading** (`collapse`). A decode step streams every weight byte once (~98 MB
//!   for the default model); on 4 KiB pages that is ~24,000 pages a step, far past the TLB's
//!   reach, against ~50 huge pages. The repacked matrices are ordinary
//!   heap allocations, written as they are repacked, and transparent huge pages default to
//!   `madvise` mode, which such an allocation never asks for, so they sat on 4 KiB pages. Each
//!   2 MiB region the weights touch is collapsed in place (`MADV_COLLAPSE`, Linux 6.1): the
//!   matrices lie side by side in the heap, mostly smaller than 2 MiB, so a region also holds
//!   whatever else the heap put there, which collapsing keeps byte for byte (it changes how the
//!   pages are mapped, never what they hold). One stream's decode step ran 1.14x faster, four
//!   streams' 1.31x (docs/performance.md, "Weights on 2 MiB pages").
//! - **Fresh buffers** (`advise`): the KV cache asks before its pages are first touched
//!   (`MADV_HUGEPAGE` over the whole 2 MiB pages inside the allocation), so pages fault in 2 MiB
//!   at a time as sequences fill them.
//!
//! A kernel without these calls, one that refuses them, or one with no free huge pages leaves the
//! pages as they were: the model runs the same, at 4 KiB-page speed. Hand-written because the
//! allocator cannot be told per allocation (glibc's `glibc.malloc.hugetlb` tunable is read only at
//! process start, from the environment) and no crate wraps these two calls.

/// Bytes in a huge page (x86-64 and aarch64 with 4 KiB base pages).
pub const HUGE: usize = 2 << 20;

/// What `collapse` did: the 2 MiB regions the spans touch, and how many are now huge pages.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Collapsed {
    pub regions: usize,
    pub collapsed: usize,
}

/// The 2 MiB regions (as region numbers, address / `HUGE`) that `spans` (address, bytes) touch,
/// in order, each once.
fn regions(spans: &[(usize, usize)]) -> Vec<usize> {
    let mut r: Vec<usize> = spans
        .iter()
        .filter(|&&(_, len)| len > 0)
        .flat_map(|&(at, len)| at / HUGE..(at + len).div_ceil(HUGE))
        .collect();
    r.sort_unstable();
    r.dedup();
    r
}

/// Collapses every 2 MiB region that the memory `spans` (address, bytes) touch into a huge page,
/// where the kernel can. The spans must be live allocations of this process; the regions around
/// them may hold anything mapped or nothing (a region not wholly mapped is refused and skipped).
pub fn collapse(spans: &[(usize, usize)]) -> Collapsed {
    let regions = regions(spans);
    let mut done = Collapsed {
        regions: regions.len(),
        collapsed: 0,
    };
    #[cfg(target_os = "linux")]
    {
        let mut refused = None;
        for &r in &regions {
            // SAFETY: madvise never changes the contents of mapped memory; MADV_COLLAPSE only
            // remaps the region's pages onto one huge page holding the same bytes, and fails
            // without effect on a range that is not wholly mapped anonymous or file memory.
            let rc = unsafe {
                libc::madvise((r * HUGE) as *mut libc::c_void, HUGE, libc::MADV_COLLAPSE)
            };
            if rc == 0 {
                done.collapsed += 1;
            } else if refused.is_none() {
                refused = Some(std::io::Error::last_os_error());
            }
        }
        if let Some(e) = refused {
            tracing::debug!(
                "MADV_COLLAPSE refused {} of {} regions, first: {e}",
                done.regions - done.collapsed,
                done.regions
            );
        }
    }
    done
}

/// Asks for huge pages behind the untouched pages of a fresh allocation (`MADV_HUGEPAGE` over the
/// whole 2 MiB pages inside `at..at + bytes`).
pub fn advise(at: usize, bytes: usize) {
    let (start, end) = (at.next_multiple_of(HUGE), (at + bytes) / HUGE * HUGE);
    #[cfg(target_os = "linux")]
    if end > start {
        // SAFETY: the range lies inside a live allocation; MADV_HUGEPAGE changes how pages are
        // backed, never their contents.
        let rc =
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        if rc != 0 {
            tracing::debug!(
                "madvise(MADV_HUGEPAGE) failed: {}",
                std::io::Error::last_os_error()
            );
        }
    }
    let _ = (start, end);
}

/// The bytes that `/proc/self/smaps` reports on anonymous huge pages in the mappings that overlap
/// `at..at + bytes` (Linux; `None` elsewhere or when unreadable).
#[cfg(test)]
fn huge_bytes_within(at: usize, bytes: usize) -> Option<usize> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let (mut total, mut inside) = (0, false);
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((lo, hi)) = first.split_once('-') {
            if let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
            {
                inside = lo < at + bytes && at < hi;
                continue;
            }
        }
        if inside {
            if let Some(kb) = line.strip_prefix("AnonHugePages:") {
                total += kb
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<usize>()
                    .ok()?
                    * 1024;
            }
        }
    }
    Some(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_cover_each_span_once_in_order() {
        let h = HUGE;
        assert_eq!(regions(&[]), Vec::<usize>::new());
        assert_eq!(regions(&[(5 * h + 10, 0)]), Vec::<usize>::new());
        assert_eq!(regions(&[(5 * h, h)]), vec![5]);
        assert_eq!(regions(&[(5 * h + 1, h)]), vec![5, 6]);
        assert_eq!(
            regions(&[(9 * h - 1, 2), (5 * h, 3 * h), (6 * h + 7, 1)]),
            vec![5, 6, 7, 8, 9]
        );
    }

    /// A buffer written on 4 KiB pages ends up on huge pages where the kernel collapses them, and
    /// keeps every byte. Where it cannot (no MADV_COLLAPSE before Linux 6.1, THP set to `never`),
    /// `collapse` says so and the bytes are still unchanged.
    #[test]
    fn collapsing_keeps_every_byte() {
        let n = 3 * HUGE;
        let buf: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8).collect();
        let (at, bytes) = (buf.as_ptr() as usize, buf.len());
        let before = huge_bytes_within(at, bytes);
        let done = collapse(&[(at, bytes)]);
        assert_eq!(done.regions, regions(&[(at, bytes)]).len());
        assert!(done.collapsed <= done.regions);
        assert!(buf
            .iter()
            .enumerate()
            .all(|(i, &b)| b == (i * 7 % 251) as u8));
        let after = huge_bytes_within(at, bytes);
        if let (Some(before), Some(after)) = (before, after) {
            if done.collapsed > 0 {
                assert!(
                    after > before,
                    "{after} bytes on huge pages, {before} before"
                );
            }
        }
    }
}
