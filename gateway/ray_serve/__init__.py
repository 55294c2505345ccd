"""Ray Serve mode: the deployment classes, KV-affinity routing, and the verifier and draft pools."""
