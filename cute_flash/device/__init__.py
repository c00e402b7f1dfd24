"""Device-side building blocks shared by the sm80 and sm90 kernels: sequence geometry, block
ranges under causal/local masks, the mask itself, online softmax and accumulator views."""
