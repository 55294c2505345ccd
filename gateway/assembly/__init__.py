"""The parts every builder assembles a gateway from, below both builders (`gateway.builders`:
embedded and Ray) and Ray's deployment classes (`gateway.ray_serve.deployments`), importing
neither: `target` (the model side: worker, KV budget, step costs), `serving` (step loop, state
store, tenants, limiter, service, app, Responses API over a target), `replica` (a replica
id's store prefix and lease) and `fleet` (any replica answers for any request)."""
