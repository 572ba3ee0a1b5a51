//! Layout math, and the adapters' layout detection (`frameworks::{trtllm, vllm}`, features `trtllm`
//! and `vllm`), on the real shapes the frameworks register.
//!
//! Model: 32 layers, 8 KV heads, head dim 128, bf16 (2 bytes), 16-token pages. One block holds
//! 32 × 2 × 16 × 8 × 128 × 2 = 2 MiB; one (layer, K/V) run is 32 KiB.

#[cfg(feature = "trtllm")]
use kvbm_connector::frameworks::trtllm::detect_trtllm;
#[cfg(feature = "vllm")]
use kvbm_connector::frameworks::vllm::detect_vllm;
#[cfg(any(feature = "trtllm", feature = "vllm"))]
use kvbm_connector::layout::Region;
use kvbm_connector::layout::{check_alignment, BlockOrder, LayerSeparate};
#[cfg(any(feature = "trtllm", feature = "vllm"))]
use kvbm_connector::LayoutKind;
use kvbm_connector::{ErrorKind, KvLayout, Layout, LayoutDims};

#[cfg(any(feature = "trtllm", feature = "vllm"))]
const BLOCKS: usize = 1000;
const RUN: usize = 16 * 8 * 128 * 2;

fn llama_dims() -> LayoutDims {
    LayoutDims {
        num_layers: 32,
        outer_dim: 2,
        page_size: 16,
        inner_dim: 8 * 128,
        dtype_bytes: 2,
    }
}

#[test]
fn bytes_per_block_of_a_32_layer_model() {
    let d = llama_dims();
    d.validate().unwrap();
    assert_eq!(d.region_bytes(), RUN);
    assert_eq!(d.bytes_per_block(), 2 * 1024 * 1024);
}

#[cfg(feature = "trtllm")]
#[test]
fn trtllm_single_tensor() {
    // TensorRT-LLM: [num_blocks, num_layers, kv_factor, tokens_per_block × heads × head_dim].
    let l = detect_trtllm(&[BLOCKS, 32, 2, 16 * 8 * 128], 2, 16, None).unwrap();
    assert_eq!(l.kind(), LayoutKind::FullyContiguous);
    assert_eq!(*l.dims(), llama_dims());
    assert_eq!(l.num_blocks(), BLOCKS);
    assert_eq!(l.num_allocations(), 1);
    let r: Vec<Region> = l.regions(7).unwrap().collect();
    assert_eq!(
        r,
        [Region {
            allocation: 0,
            offset: 7 * 2 * 1024 * 1024,
            len: 2 * 1024 * 1024,
            canonical_offset: 0
        }]
    );
    // The trailing dims may also come unflattened.
    let l2 = detect_trtllm(
        &[BLOCKS, 32, 2, 16, 8, 128],
        2,
        16,
        Some(LayoutKind::FullyContiguous),
    )
    .unwrap();
    assert_eq!(l2, l);
}

#[cfg(feature = "trtllm")]
#[test]
fn trtllm_refuses_contradicting_override_and_bad_shapes() {
    let e = detect_trtllm(
        &[BLOCKS, 32, 2, 16384],
        2,
        16,
        Some(LayoutKind::LayerSeparateOuterMajor),
    )
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidLayout);
    assert!(e.to_string().contains("contradicts"), "{e}");
    assert_eq!(
        detect_trtllm(&[BLOCKS, 32, 2], 2, 16, None)
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidLayout
    );
    assert_eq!(
        detect_trtllm(&[BLOCKS, 32, 3, 16384], 2, 16, None)
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidLayout
    );
    // 1000 elements per (layer, outer) are not a multiple of 16 tokens.
    assert_eq!(
        detect_trtllm(&[BLOCKS, 32, 2, 1000], 2, 16, None)
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidLayout
    );
    assert_eq!(
        detect_trtllm(&[0, 32, 2, 16384], 2, 16, None)
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidLayout
    );
    assert_eq!(
        detect_trtllm(&[BLOCKS, 32, 2, 16384], 3, 16, None)
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidLayout
    );
}

#[cfg(feature = "vllm")]
fn layers(shape: &[usize]) -> Vec<Vec<usize>> {
    vec![shape.to_vec(); 32]
}

#[cfg(feature = "vllm")]
#[test]
fn vllm_flash_attention_is_outer_major() {
    // FlashAttention: per layer [2, num_blocks, block_size, num_kv_heads, head_size].
    let shape = [2, BLOCKS, 16, 8, 128];
    for n in [None, Some(BLOCKS)] {
        let l = detect_vllm(&layers(&shape), 2, 16, n, None).unwrap();
        assert_eq!(l.kind(), LayoutKind::LayerSeparateOuterMajor);
        assert_eq!(*l.dims(), llama_dims());
        assert_eq!(l.num_blocks(), BLOCKS);
        assert_eq!(l.num_allocations(), 32);
        assert_eq!(l.allocation_bytes(), 2 * BLOCKS * RUN);
    }
    let l = detect_vllm(&layers(&shape), 2, 16, None, None).unwrap();
    let r: Vec<Region> = l.regions(5).unwrap().collect();
    assert_eq!(r.len(), 64);
    // Layer 3, V (outer 1): allocation 3, offset (1 × N + 5) runs, canonical run 7.
    assert_eq!(
        r[7],
        Region {
            allocation: 3,
            offset: (BLOCKS + 5) * RUN,
            len: RUN,
            canonical_offset: 7 * RUN
        }
    );
}

#[cfg(feature = "vllm")]
#[test]
fn vllm_flashinfer_is_block_major() {
    // FlashInfer: per layer [num_blocks, 2, block_size, num_kv_heads, head_size].
    let l = detect_vllm(&layers(&[BLOCKS, 2, 16, 8, 128]), 2, 16, None, None).unwrap();
    assert_eq!(l.kind(), LayoutKind::LayerSeparateBlockMajor);
    assert_eq!(*l.dims(), llama_dims());
    let r: Vec<Region> = l.regions(5).unwrap().collect();
    assert_eq!(
        r[7],
        Region {
            allocation: 3,
            offset: (5 * 2 + 1) * RUN,
            len: RUN,
            canonical_offset: 7 * RUN
        }
    );
}

#[cfg(feature = "vllm")]
#[test]
fn vllm_mla_latent_has_one_outer() {
    // MLA (e.g. DeepSeek): per layer [num_blocks, block_size, kv_lora_rank + rope_dim].
    let l = detect_vllm(&vec![vec![BLOCKS, 16, 576]; 61], 2, 16, None, None).unwrap();
    assert_eq!(l.kind(), LayoutKind::LayerSeparateBlockMajor);
    assert_eq!(l.dims().outer_dim, 1);
    assert_eq!(l.dims().inner_dim, 576);
    assert_eq!(l.bytes_per_block(), 61 * 16 * 576 * 2);
}

#[cfg(feature = "vllm")]
#[test]
fn vllm_override_contradicting_the_shape_is_refused() {
    let shape = [2, BLOCKS, 16, 8, 128];
    let e = detect_vllm(
        &layers(&shape),
        2,
        16,
        Some(BLOCKS),
        Some(LayoutKind::LayerSeparateBlockMajor),
    )
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidLayout);
    assert!(e.to_string().contains("contradicts"), "{e}");
    let e = detect_vllm(
        &layers(&shape),
        2,
        16,
        None,
        Some(LayoutKind::FullyContiguous),
    )
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidLayout);
    // An override that agrees is accepted.
    let l = detect_vllm(
        &layers(&shape),
        2,
        16,
        None,
        Some(LayoutKind::LayerSeparateOuterMajor),
    )
    .unwrap();
    assert_eq!(l.kind(), LayoutKind::LayerSeparateOuterMajor);
}

#[cfg(feature = "vllm")]
#[test]
fn vllm_ambiguous_shape_needs_num_blocks_or_override() {
    // Two blocks: [2, 2, ...] reads both ways with the same byte size.
    let shape = [2, 2, 16, 8, 128];
    let e = detect_vllm(&layers(&shape), 2, 16, None, None).unwrap_err();
    assert!(e.to_string().contains("ambiguous"), "{e}");
    let l = detect_vllm(
        &layers(&shape),
        2,
        16,
        None,
        Some(LayoutKind::LayerSeparateBlockMajor),
    )
    .unwrap();
    assert_eq!(l.kind(), LayoutKind::LayerSeparateBlockMajor);
}

#[cfg(feature = "vllm")]
#[test]
fn vllm_mismatched_layers_and_bad_block_count() {
    let mut shapes = layers(&[2, BLOCKS, 16, 8, 128]);
    shapes[9] = vec![2, BLOCKS, 16, 8, 64];
    let e = detect_vllm(&shapes, 2, 16, None, None).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidLayout);
    assert_eq!(e.context_value("layer"), Some("9"));
    let e = detect_vllm(&layers(&[2, BLOCKS, 16, 8, 128]), 2, 16, Some(999), None).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidLayout);
    assert_eq!(
        detect_vllm(&[], 2, 16, None, None).unwrap_err().kind(),
        ErrorKind::InvalidLayout
    );
    assert_eq!(
        detect_vllm(&layers(&[2, BLOCKS, 15, 8, 128]), 2, 16, None, None)
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidLayout
    );
}

/// vLLM's CPU attention (`CPU_ATTN`): per layer `[num_blocks, num_kv_heads, block_size,
/// 2 × head_size]`, each (block, head) slab K then V. With 4 heads no other reading fits; with 1
/// or 2 the shape also reads as block-major K/V, so it needs the override (which the Python
/// connector passes when vLLM's backend is `CPU_ATTN`), and the override must fit the shape.
#[cfg(feature = "vllm")]
#[test]
fn vllm_cpu_attention_is_head_major() {
    // The shape the issue reports refused: [2048, 4, 32, 128] (4 KV heads, head size 64).
    let shape = [2048, 4, 32, 128];
    for (n, over) in [
        (None, None),
        (Some(2048), None),
        (None, Some(LayoutKind::LayerSeparateHeadMajor)),
    ] {
        let l = detect_vllm(&layers(&shape), 4, 32, n, over).unwrap();
        assert_eq!(l.kind(), LayoutKind::LayerSeparateHeadMajor);
        assert_eq!(l.num_blocks(), 2048);
        assert_eq!(l.dims().outer_dim, 2);
        assert_eq!(l.dims().inner_dim, 4 * 64);
        assert_eq!(l.allocation_bytes(), 2048 * 4 * 32 * 128 * 4);
        // Block 3, layer 0, V (outer 1), token 5, head 2: element [3, 2, 32 + 5, 0] of the
        // kernels' [blocks, heads, 2 × page, head_size] view.
        let r: Vec<Region> = l.regions(3).unwrap().collect();
        let i = (32 + 5) * 4 + 2;
        assert_eq!(r[i].allocation, 0);
        assert_eq!(r[i].offset, ((3 * 4 + 2) * 64 + 32 + 5) * 64 * 4);
        assert_eq!(r[i].canonical_offset, i * 64 * 4);
    }
    // Two heads (what worked by luck, read as block-major): ambiguous without the override.
    let two = [2048, 2, 32, 128];
    let e = detect_vllm(&layers(&two), 4, 32, None, None).unwrap_err();
    assert!(e.to_string().contains("ambiguous"), "{e}");
    assert!(e.to_string().contains("layer_separate_head_major"), "{e}");
    let l = detect_vllm(
        &layers(&two),
        4,
        32,
        Some(2048),
        Some(LayoutKind::LayerSeparateHeadMajor),
    )
    .unwrap();
    assert_eq!(l.kind(), LayoutKind::LayerSeparateHeadMajor);
    assert_eq!(l.dims().inner_dim, 2 * 64);
    // The override must fit: an odd last dim or a page that is not block_size is refused.
    for bad in [[2048, 2, 32, 127], [2048, 2, 16, 128]] {
        let e = detect_vllm(
            &layers(&bad),
            4,
            32,
            None,
            Some(LayoutKind::LayerSeparateHeadMajor),
        )
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidLayout, "{bad:?}");
    }
}

#[test]
fn zero_and_overflowing_dimensions_are_errors() {
    let mut d = llama_dims();
    d.num_layers = 0;
    assert_eq!(
        Layout::fully_contiguous(d, 4).unwrap_err().kind(),
        ErrorKind::InvalidLayout
    );
    assert_eq!(
        Layout::fully_contiguous(llama_dims(), 0)
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidLayout
    );
    let mut d = llama_dims();
    d.inner_dim = usize::MAX / 4;
    assert_eq!(
        Layout::fully_contiguous(d, 4).unwrap_err().kind(),
        ErrorKind::InvalidLayout
    );
    assert_eq!(
        Layout::fully_contiguous(llama_dims(), usize::MAX / 1024)
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidLayout
    );
    #[cfg(feature = "trtllm")]
    assert_eq!(
        detect_trtllm(&[BLOCKS, 32, 2, usize::MAX / 2, 4], 2, 16, None)
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidLayout
    );
}

#[test]
fn out_of_range_block_is_an_error() {
    let l = LayerSeparate::new(llama_dims(), 4, BlockOrder::BlockMajor).unwrap();
    assert_eq!(l.regions(4).unwrap_err().kind(), ErrorKind::OutOfRange);
}

#[test]
fn alignment_checks() {
    check_alignment("cache", 0x1000, 256).unwrap();
    assert_eq!(
        check_alignment("cache", 0x1002, 4).unwrap_err().kind(),
        ErrorKind::InvalidLayout
    );
    assert_eq!(
        check_alignment("cache", 0x1000, 3).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
}

#[test]
fn layouts_serialize_with_their_kind() {
    let l = Layout::layer_separate(llama_dims(), 8, BlockOrder::OuterMajor).unwrap();
    let json = toml::to_string(&l).unwrap();
    assert!(json.contains("kind = \"layer_separate\""), "{json}");
    // Head-major keeps its head count; a layout written before heads existed reads as one head.
    let h = Layout::layer_separate_head_major(llama_dims(), 8, 8).unwrap();
    let text = toml::to_string(&h).unwrap();
    assert_eq!(toml::from_str::<Layout>(&text).unwrap(), h, "{text}");
    let old: Layout = toml::from_str(&json.replace("num_heads = 1\n", "")).unwrap();
    assert_eq!(old, l);
}
