"""Pallas Triton (GPU) variants: no scalar prefetch, so tile -> slot ids travel as ordinary int32
operands, the stacked weights are whole-array (unblocked) operands and each program slices its
slot's weights inside the kernel with dynamic pl.ds indexing. Every load/store and dot is a
power-of-two block (dots at least 16 in each dim, f32 accumulation); the wrappers zero-pad ranks
and feature dims as needed and slice the results back."""
