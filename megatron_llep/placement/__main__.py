from megatron_llep.placement.cli import main

main()
