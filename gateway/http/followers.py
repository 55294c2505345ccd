"""Followers are requests (gateway/followers.py): the dependencies that charge them, run right
after authentication and before anything else the route does, so a tenant over its limits is
refused (429) before its follower reads anything or takes an ingress slot for long.

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


async def get_followers(request: Request) -> FollowerGate:
    return request.app.state.followers


FollowersDep = Annotated[FollowerGate, Depends(get_followers)]


async def follower_slot(tenant: TenantDep, followers: FollowersDep) -> AsyncIterator[None]:
    async with followers.held(tenant):
        yield


async def response_reader(tenant: TenantDep, followers: FollowersDep,
                          stream: bool = False) -> AsyncIterator[None]:
    if not stream:
        await followers.charge(tenant)
        yield
        return
    async with followers.held(tenant):
        yield


FollowerDep = Annotated[None, Depends(follower_slot)]
ResponseReaderDep = Annotated[None, Depends(response_reader)]
