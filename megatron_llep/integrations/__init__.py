"""LLEP and CAP plugged into what users run: Megatron-LM's training loop (:mod:`.megatron_lm`),
the LLEP command-line flags every entry point shares (:mod:`.flags`), a placement applied to a live
model (:mod:`.placement`), routing traces recorded from a live model (:mod:`.routing_traces`)."""
