//! Shape reading shared by the adapters' layout detection (`trtllm::detect_trtllm`,
//! `vllm::detect_vllm`): the elements per token that an engine's trailing tensor dims hold, and
//! shapes as error messages print them. Which dims an engine registers is each adapter's business.

use crate::error::{Error, Result};

/// A shape as error messages print it.
pub(super) fn fmt_shape(shape: &[usize]) -> String {
    format!("{shape:?}")
}

/// `inner_dim` from the dims after the block/outer dims of `shape` (`tail`), which hold
/// `page_size × inner_dim` elements.
pub(super) fn inner_from_tail(tail: &[usize], page_size: usize, shape: &[usize]) -> Result<usize> {
    if page_size == 0 {
        return Err(Error::invalid_layout("page_size must be non-zero").with("dim", "page_size"));
    }
    let elems = tail
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| Error::invalid_layout("tensor element count overflows usize"))?;
    if elems == 0 || elems % page_size != 0 {
        return Err(Error::invalid_layout(format!(
            "trailing dims {} of shape {} hold {elems} elements, not a non-zero multiple of page_size {page_size}",
            fmt_shape(tail),
            fmt_shape(shape)
        )));
    }
    Ok(elems / page_size)
}
