"""``nakta-serve``: an OpenAI-compatible HTTP server over the generation engine.

``cli`` parses the settings and starts everything; ``bridge`` runs the ``Generator`` in one
background thread that owns the model (requests join between decode chunks, cancelled ones
give their pages back); ``app`` holds the routes (a thin layer, no model code); ``protocol``
checks request bodies into plain objects and shapes errors as OpenAI does; ``logprobs`` scores
token sequences for ``echo`` / ``logprobs``; ``chat`` turns messages into a prompt; ``metrics``
is ``/metrics``; ``lockstep`` keeps every rank's engine in step under tensor parallelism
(rank 0 serves, the others follow). See docs/serving.md.
"""
