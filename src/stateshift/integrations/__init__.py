"""Drop-ins for other frameworks' functions, built on the engine; each imported only on request.

- ``stateshift.integrations.verl``: verl 0.9.1's offload, load, copy and
  restore functions (``verl/utils/megatron_utils.py``, ``verl/utils/fsdp_utils.py``)
  under their own names, and ``install()`` / ``uninstall()`` to put them in
  place of verl's (``docs/guide/verl.md``).

Nothing in ``stateshift.core`` or ``stateshift.backends`` imports this
package, and importing it imports nothing from the framework it serves.
"""
