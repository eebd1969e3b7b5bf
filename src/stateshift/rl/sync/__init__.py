"""Weight sync: publish a ``ModelState``'s weights to other processes, receive them there.

Trainer side::

    from stateshift.rl.sync import WeightPublisher
    pub = WeightPublisher(state, transport="auto")      # shared_host / cuda_ipc / broadcast
    send_to_rollouters(pub.handle().to_json())          # plain data: a queue, a Ray object, argv
    for step in ...:
        train_step()
        pub.publish(step)                               # enqueues one snapshot; returns at once
    pub.close()

Receiving side::

    from stateshift.rl.sync import WeightReceiver
    rx = WeightReceiver(handle_json, name="rollout-0")
    version = rx.load_into(model)                       # in place, by name, strict coverage
    with rx.receive(min_version=version + 1) as (v, weights):
        engine.model.load_weights(weights)              # (name, tensor) pairs, as vLLM takes them

Guarantees (docs/guide/weight-sync.md): a receiver sees a version whole or not at
all; a version stays alive while a receiver holds it; a receiver that dies or
hangs is reclaimed (a ``SyncError`` of kind ``"receiver_lost"`` in ``WeightPublisher.lost``) and the
publisher goes on; a publisher that dies mid-publish leaves receivers on the
last whole version.
"""

from ...errors import BudgetError, SyncError
from .handle import TRANSPORTS, SyncHandle
from .publisher import Publication, WeightPublisher, pick_transport
from .receiver import Receipt, WeightReceiver

__all__ = [
    "BudgetError",
    "Publication",
    "Receipt",
    "SyncError",
    "SyncHandle",
    "TRANSPORTS",
    "WeightPublisher",
    "WeightReceiver",
    "pick_transport",
]
