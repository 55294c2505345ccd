"""Followers are requests (gateway/followers.py): the dependencies that charge them, run right
after authentication and before anything else the route does, so a tenant over its limits is
refused (429) before its follower reads anything or takes an ingress slot for long. A refusal
here is noted for the key's next requests to be refused at the gate (gateway/http/early_refusal.py).

    FollowerDep        a follower slot of the caller's tenant for as long as the response
                       streams (FastAPI runs a `yield` dependency's exit once the response has
                       been sent, or the client has gone): the resume endpoint
    ResponseReaderDep  GET /v1/responses/{id}: with `stream=true` a follower slot as above,
                       otherwise one request charged to rpm
"""
from __future__ import annotations

from typing import Annotated, AsyncIterator

from fastapi import Depends, Request

from gateway.followers import FollowerGate
from gateway.http.deps import TenantDep
from gateway.http.early_refusal import remember_tenant


async def get_followers(request: Request) -> FollowerGate:
    return request.app.state.followers


FollowersDep = Annotated[FollowerGate, Depends(get_followers)]


async def follower_slot(request: Request, tenant: TenantDep,
                        followers: FollowersDep) -> AsyncIterator[None]:
    remember_tenant(request, tenant)         # a refusal below is noted for the key's next ones
    async with followers.held(tenant):
        yield


async def response_reader(request: Request, tenant: TenantDep, followers: FollowersDep,
                          stream: bool = False) -> AsyncIterator[None]:
    remember_tenant(request, tenant)
    if not stream:
        await followers.charge(tenant)
        yield
        return
    async with followers.held(tenant):
        yield


FollowerDep = Annotated[None, Depends(follower_slot)]
ResponseReaderDep = Annotated[None, Depends(response_reader)]
