"""Which KV blocks a sparse layer reads: block scoring and the SoloHead / headwise policies (policy.py), scores of the
always-kept blocks (kept_blocks.py), the slot-cache plan on the device (slot_plan.py) and its numpy contract
(slot_table.py), and the hooks that let benchmarks record or replay selections (hooks.py)."""
