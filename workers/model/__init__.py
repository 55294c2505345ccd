"""The target model: loading, the lean forward and its CPU kernels, KV caches."""
