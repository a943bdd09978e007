"""``python -m megatron_llep.placement``: the CAP placement command line (plan, report, apply)."""

from megatron_llep.placement.cli import main

main()
