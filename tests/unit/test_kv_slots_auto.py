"""`--num-slots` auto: the KV slot count from free memory and the model's bytes per slot."""

from ultrafast.model.kv_budget import AUTO_MAX_SLOTS, AUTO_MIN_SLOTS, auto_num_slots

MIB = 1024**2


def test_slots_fill_a_sixteenth_of_free_memory_within_bounds():
    per_position = 23 * 1024  # SmolLM2-135M's f16 K+V over 30 layers, about 23 KiB
    n, why = auto_num_slots(per_position, 2048, 16 * 1024 * MIB)
    assert n == (16 * 1024 * MIB // 16) // (per_position * 2048) == 22
    assert "22 slots" in why and "2048 positions" in why
    # a small model's slots are cheap: the cap; a large one's dear: the floor
    assert auto_num_slots(3 * 1024, 2048, 16 * 1024 * MIB)[0] == AUTO_MAX_SLOTS
    assert auto_num_slots(2 * MIB, 8192, 16 * 1024 * MIB)[0] == AUTO_MIN_SLOTS


def test_unknown_sizes_keep_the_fixed_default():
    assert auto_num_slots(None, 2048, 1 << 34)[0] == 8
    assert auto_num_slots(1024, 2048, None)[0] == 8
