"""Every shipped kernel variant compiles to the machine code recorded in ``tests/sass_manifest.json``
(``tests/sass_manifest.py`` says how it is built and rewritten): host-side changes -- module layout,
configs, dispatch -- must not change what runs on the GPU."""

from __future__ import annotations

import os

import pytest

import sass_manifest


@pytest.mark.slow
def test_every_shipped_variant_compiles_to_the_recorded_sass(capsys: pytest.CaptureFixture) -> None:
    recorded = sass_manifest.load()
    variants = sass_manifest.variants()
    assert {v.label() for v in variants} == set(recorded), "the variant list and the manifest differ"
    workers = int(os.environ.get("CUTE_FLASH_COMPILE_WORKERS", os.cpu_count() or 1))
    with capsys.disabled():
        print(f"\n[sass manifest] compiling {len(variants)} variants in {workers} processes "
              f"(~{10 * len(variants) // max(workers, 1) // 60} min)...", flush=True)
    now = sass_manifest.compute(variants, workers)
    changed = sorted(label for label, digests in now.items() if digests != recorded[label])
    assert not changed, f"{len(changed)} variants compile to other SASS: {changed[:20]}"


def test_sass_digests_ignore_addresses_and_symbol_names() -> None:
    from cute_flash.tools import inspect as ins

    def listing(name: str, base: int) -> str:
        return "\n".join([f".text.{name}:", f"        /*{base:04x}*/   IMAD R0, R1, 0x4, RZ ;  /* 0x123 */",
                          ".L_x_1:", f"        /*{base + 16:04x}*/   EXIT ;"])

    same = ins.sass_digests(listing("kernel_b_mod_two", 0x20))
    assert ins.sass_digests(listing("kernel_a_mod_one", 0)) == same
    other = listing("kernel_a", 0).replace("0x4", "0x8")
    assert ins.sass_digests(other) != ins.sass_digests(listing("kernel_a", 0))
