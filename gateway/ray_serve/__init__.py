"""Ray Serve mode: the deployment classes (`deployments`, and `ingress`, whose replicas load no
model code), KV-affinity routing, and the verifier and draft pools."""
