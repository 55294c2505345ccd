"""The OpenAI Responses API over specgate's scheduler: stored, background and resumable responses.

    objects   the response object and its parts (pure)
    events    a response's stream events, numbered, as a function of its committed tokens (pure)
    quota     what a tenant may keep stored (count, bytes, TTL), and the refusal past it (pure)
    store     the stored responses (who owns each, what it asked, its final output), with expiry
              and each tenant's count and bytes; in memory here, in Redis in redis_store
    reader    a response read back: its object, its events as its request commits them
    keeper    a response kept: stored within its tenant's quota, its output when it ends, and
              dropped when deleted or its tenant removed
    service   create / retrieve / cancel / delete, over the generation service, the reader and
              the keeper

Why events are a function of the tokens: the step loop persists a step's tokens before it streams
them (scheduler/loop.py), so anyone who can read the state store can rebuild every event a client
was sent, with the same sequence numbers, whatever restarted in between. Nothing else needs
persisting per event, and a resumed stream costs no verification work.
"""
