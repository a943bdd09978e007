"""Generate text with a Megatron-Core GPT MoE model (LLEP or plain EP) through Megatron-Core's own
static inference engine and KV cache, on every rank of a torchrun job.

CPU smoke run (tiny gpt-oss at random weights, byte tokenizer, 2 gloo ranks, LLEP spilling)::

    python launch/torchrun.py --nproc_per_node 2 recipes/generate.py --random-init --prompt "Hello" --force-routing 0.9:4

A fine-tuned model, chat prompts from a file, sampling::

    python launch/torchrun.py --nproc_per_node 2 recipes/generate.py --load ckpt --prompts prompts.jsonl \\
        --max-new-tokens 128 --temperature 0.8 --top-p 0.95 --seed 7 --output generations.jsonl

Prompts (``--prompts`` JSONL with ``{"prompt": text}`` or ``{"messages": [...]}`` records, and/or
``--prompt TEXT``) are rendered with the tokenizer's chat template and its generation prompt when it
has one (``--no-chat-template``: raw text after BOS). Decoding is greedy unless ``--temperature``,
``--top-k`` or ``--top-p`` ask for sampling; every sequence stops at the tokenizer's end-of-sequence
token or after ``--max-new-tokens``.

Expert parallelism needs every rank of an EP group to run the same forwards (each MoE layer is an
all-to-all): every rank generates the same prompts with the same seed, and the tokens sampled on
rank 0 are broadcast at every step, so all ranks decode the same sequences and stop together. The
data-parallel replicas therefore repeat each other's work (the experts and their memory are still
split EP ways).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Optional, Sequence

os.environ.setdefault("TQDM_DISABLE", "1")  # Megatron's engine draws a progress bar per rank and batch

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from recipes.runtime.cpu_warnings import quiet_known_cpu_warnings  # noqa: E402

quiet_known_cpu_warnings()  # before the first Megatron-Core import, which warns at import time

from recipes.runtime import model_building, model_sources, sft_data  # noqa: E402
from recipes.runtime.entry_point import EntryPoint, RankZeroArgumentParser, check_existing_files, utf8_text  # noqa: E402
from recipes.runtime.logits import mtp_skipped  # noqa: E402

ENTRY = EntryPoint("generate")
POSITIVE = ("max_new_tokens", "max_batch_size", "temperature", "top_k", "top_p")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = RankZeroArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    prompts = parser.add_argument_group("prompts")
    prompts.add_argument("--prompts", default=None, metavar="FILE",
                         help='JSONL, one {"prompt": text} or {"messages": [{"role", "content"}, ...]} per line')
    prompts.add_argument("--prompt", action="append", default=[], metavar="TEXT", type=utf8_text,
                         help="a prompt (repeatable; after those of --prompts)")
    prompts.add_argument("--no-chat-template", dest="chat_template", action="store_false",
                         help="feed prompts as raw text after BOS even when the tokenizer has a chat template")
    decoding = parser.add_argument_group("decoding (greedy unless --temperature, --top-k or --top-p)")
    decoding.add_argument("--max-new-tokens", type=int, default=32)
    decoding.add_argument("--temperature", type=float, default=None, help="sample at this temperature (default 1.0 "
                                                                           "when sampling)")
    decoding.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens (1: greedy)")
    decoding.add_argument("--top-p", type=float, default=None,
                          help="sample from the smallest set of tokens whose probability reaches p (not with --top-k)")
    decoding.add_argument("--max-batch-size", type=int, default=8,
                          help="prompts decoded together (the KV cache holds this many sequences)")
    decoding.add_argument("--log-probs", action=argparse.BooleanOptionalAction, default=True,
                          help="record each generated token's log-probability (Megatron materializes the prompt's "
                               "logits for it: batch x prompt x vocabulary floats)")
    model_sources.add_arguments(parser, "generate", "write one JSON line per prompt: prompt, generated text, token ids, "
                                                    "per-token log-probs, finish reason")
    args = parser.parse_args(argv)
    model_sources.check_arguments(parser, args, POSITIVE)
    if args.top_p is not None and args.top_p > 1:
        parser.error(f"--top-p must be at most 1, got {args.top_p}")
    if args.top_k is not None and args.top_p is not None:
        parser.error("--top-k and --top-p exclude each other (Megatron's sampler takes one); choose one")
    if args.prompts is None and not args.prompt:
        parser.error("no prompt given: pass --prompt TEXT (repeatable) or --prompts FILE (JSONL)")
    check_existing_files(parser, [(args.prompts, "--prompts")])
    return args


def read_prompts(args: argparse.Namespace, tokenizer: sft_data.Tokenizer) -> list[tuple[Any, list[int]]]:
    """Every prompt as given (a string or a messages list) and its token ids, ``--prompts`` first."""
    records = list(sft_data.jsonl_objects(args.prompts, "prompts file")) if args.prompts else []
    records += [(f"--prompt #{i + 1}", {"prompt": text}) for i, text in enumerate(args.prompt)]
    if not records:
        raise sft_data.DataError(f"--prompts {args.prompts}: no prompts")
    prompts = []
    for where, record in records:
        ids = sft_data.prompt_token_ids(record, tokenizer, where, args.chat_template)
        if not ids:
            raise sft_data.DataError(f"{where}: the prompt is empty (and the tokenizer has no BOS to start from)")
        prompts.append((record.get("prompt", record.get("messages")), ids))
    return prompts


class MegatronTokenizer:
    """The members of a tokenizer Megatron's TextGenerationController reads."""

    def __init__(self, tokenizer: sft_data.Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.eod, self.bos, self.vocab_size = tokenizer.eos_id, tokenizer.bos_id, tokenizer.vocab_size

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text)

    def detokenize(self, ids: list[int], **_: Any) -> str:
        return self._tokenizer.decode(ids)


class PositionalRouting:
    """``--force-routing`` for generation: each token's experts are a function of (layer, prompt,
    position), so that every forward schedule routes a token alike (prefill, one-token decode steps,
    a full recompute; LLEP or plain EP). A prompt's choices are drawn once for all its positions
    (up to ``max_length``) while its batch runs."""

    def __init__(self, layers: list, max_length: int, fraction: float, hot: int, seed: int) -> None:
        self.layers, self.max_length, self.fraction, self.hot, self.seed = layers, max_length, fraction, hot, seed
        self._drawn: dict[int, list[np.ndarray]] = {}  # prompt -> per layer [max_length, K]

    def _choices(self, prompt: int) -> list[np.ndarray]:
        from megatron_llep.planning.scenarios import imbalanced_topk

        if prompt not in self._drawn:
            config = self.layers[0].config
            self._drawn[prompt] = [
                imbalanced_topk(self.max_length, config.num_moe_experts, config.moe_router_topk, self.fraction, self.hot,
                                seed=self.seed + 1_000_003 * prompt + 1009 * i) for i in range(len(self.layers))]
        return self._drawn[prompt]

    def force(self, prompts: Sequence[int], position_ids: torch.Tensor) -> None:
        """Route the next forward, whose batch row ``b`` is prompt ``prompts[b]`` at ``position_ids[b]``."""
        from megatron_llep.runtime.forced_routing import force_routing

        for prompt in set(self._drawn) - set(prompts):  # a finished batch's
            del self._drawn[prompt]
        positions = position_ids.cpu().numpy()
        rows = [self._choices(prompt) for prompt in prompts]
        for i, layer in enumerate(self.layers):
            chosen = np.stack([row[i][positions[b]] for b, row in enumerate(rows)])  # [batch, sequence, K]
            # the MoE layer sees the tokens sequence-major ([s, b] flattened)
            force_routing(layer.router, chosen.transpose(1, 0, 2).reshape(-1, chosen.shape[-1]))


def generation_classes():
    """The GPTInferenceWrapper and TextGenerationController subclasses generate() drives (defined
    once Megatron-Core is imported)."""
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    class TimedWrapper(GPTInferenceWrapper):
        """Megatron's forward step, timed (prefill and decode apart) and, with ``--force-routing``,
        routed by :class:`PositionalRouting`."""

        routing: Optional[PositionalRouting] = None
        batch_prompts: Sequence[int] = ()
        timings: list

        def run_one_forward_step(self, inference_input: dict, *args: Any, **kwargs: Any):
            if self.routing is not None:
                self.routing.force(self.batch_prompts, inference_input["position_ids"])
            decode = self.inference_context.is_decode_only()
            tokens = inference_input["tokens"].numel()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            logits = super().run_one_forward_step(inference_input, *args, **kwargs)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.timings.append((decode, tokens, time.perf_counter() - start))
            return logits

    class LockstepController(TextGenerationController):
        """Megatron's static-batch loop with the tokens sampled on rank 0 broadcast at every step, so
        that every rank decodes the same sequences and runs the same number of forwards. Only the
        tokenizer's ids are sampled (the model's vocabulary is padded beyond them); the log-probs stay
        those of the model's whole distribution."""

        def generate_all_output_tokens_static_batch(self, active_requests, *args: Any, **kwargs: Any):
            self.inference_wrapped_model.batch_prompts = [int(request_id) for request_id in active_requests]
            return super().generate_all_output_tokens_static_batch(active_requests, *args, **kwargs)

        def sample_from_logits(self, last_token_logits: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if last_token_logits.shape[-1] > self.tokenizer.vocab_size:
                last_token_logits = last_token_logits.clone()
                last_token_logits[:, self.tokenizer.vocab_size:] = float("-inf")
            sampled = super().sample_from_logits(last_token_logits, *args, **kwargs)
            dist.broadcast(sampled, src=0)
            return sampled

    return TimedWrapper, LockstepController


def generate(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run the generation; returns one record per prompt (the JSONL of ``--output``) on every rank."""
    from megatron_llep.compat import inference as mcore_inference
    from recipes.runtime import dashboard, watchdog

    started = time.perf_counter()
    rank, world, device = ENTRY.start(args.watchdog_timeout)
    source = model_sources.open_source(args, ENTRY, rank)
    tokenizer = model_sources.load_tokenizer(args, ENTRY, rank)
    try:
        prompts = read_prompts(args, tokenizer)
        if args.top_k is not None and args.top_k > tokenizer.vocab_size:
            raise sft_data.DataError(f"--top-k {args.top_k} exceeds the {tokenizer.vocab_size} tokens of the tokenizer "
                                     f"{args.tokenizer}: give at most {tokenizer.vocab_size}")
    except sft_data.DataError as err:
        ENTRY.fail(err, rank)
    longest = max(len(ids) for _, ids in prompts)
    args.seq_length = longest + args.max_new_tokens  # the longest sequence the model sees (checked against it)
    args.seq_length_source = (f"the longest prompt ({longest} tokens) plus --max-new-tokens {args.max_new_tokens}",
                              "shorten the prompt or lower --max-new-tokens")
    recipe, model, layout = model_sources.build(args, source, ENTRY, rank, world, device, tokenizer.vocab_size)
    layers = model_building.moe_layers(model)
    recorder = model_building.start_routing_trace(model, args, rank)
    load_meter = dashboard.MoELoadMeter(model)

    wrapper_class, controller_class = generation_classes()
    batch = min(args.max_batch_size, len(prompts))
    engine = mcore_inference.static_inference_engine(model, MegatronTokenizer(tokenizer), batch, args.seq_length,
                                                     args.seed, wrapper_class, controller_class)
    wrapper = engine.controller.inference_wrapped_model
    wrapper.timings = []
    if args.force_routing:
        wrapper.routing = PositionalRouting(layers, args.seq_length, *args.force_routing, seed=args.seed)
    sampling = args.temperature is not None or args.top_k is not None or args.top_p is not None
    params = mcore_inference.sampling_params(
        args.max_new_tokens, temperature=args.temperature or 1.0, top_k=(args.top_k or 0) if sampling else 1,
        top_p=args.top_p or 0.0, log_probs=args.log_probs)
    requests = [mcore_inference.inference_request(i, tokenizer.decode(ids), ids, params)
                for i, (_, ids) in enumerate(prompts)]
    ENTRY.say(f"{recipe.name} on {world} {device.type} ranks: TP={layout['tp']} PP={layout['pp']} EP={layout['ep']} "
              f"DP={layout['dp']}, {'LLEP' if args.llep else 'plain EP'}; {len(prompts)} prompt(s) of up to {longest} "
              f"tokens, up to {args.max_new_tokens} new tokens each, {'sampling' if sampling else 'greedy'}, "
              f"{batch} at a time (Megatron-Core's static inference engine, KV cache)")
    if args.force_routing:
        ENTRY.say(f"forcing routing: {args.force_routing[0]:.0%} of tokens into {args.force_routing[1]} hot expert(s)")

    watchdog.progress("generating")
    with mtp_skipped(model):  # the main model's next-token logits (DeepSeek-V3's MTP layers predict further ahead)
        finished = {request.request_id: request for request in mcore_inference.generate(engine, requests)}
    moe_metrics, _, _ = dashboard.gather_moe_metrics(load_meter)
    records = []
    for index, (prompt, ids) in enumerate(prompts):
        tokens, log_probs = mcore_inference.generated(finished[index])
        records.append(dict(index=index, prompt=prompt, prompt_token_ids=ids, generated_text=tokenizer.decode(tokens),
                            generated_token_ids=tokens, log_probs=log_probs,
                            finish_reason="length" if len(tokens) >= args.max_new_tokens else "eos"))
    for record in records:
        ENTRY.say(f"#{record['index'] + 1} ({len(record['prompt_token_ids'])} prompt tokens, "
                  f"{len(record['generated_token_ids'])} generated, {record['finish_reason']}): "
                  f"{record['generated_text']!r}")
    prefill = [(tokens, seconds) for decode, tokens, seconds in wrapper.timings if not decode]
    decode_seconds = sum(seconds for decode, _, seconds in wrapper.timings if decode)
    prefill_rate = sum(t for t, _ in prefill) / max(sum(s for _, s in prefill), 1e-9)
    generated_tokens = sum(len(record["generated_token_ids"]) for record in records)
    decode_rate = generated_tokens / max(decode_seconds, 1e-9)
    ENTRY.say(f"prefill {prefill_rate:,.0f} tokens/s, decode {decode_rate:,.1f} tokens/s ({generated_tokens} tokens "
              f"in {len(wrapper.timings) - len(prefill)} decode steps, {decode_seconds:.2f} s) | "
              f"{model_building.moe_summary(args, moe_metrics)}")
    metrics = {"generate/tokens": generated_tokens, "throughput/prefill_tokens_per_sec": prefill_rate,
               "throughput/decode_tokens_per_sec": decode_rate, **moe_metrics}
    model_sources.publish(args, ENTRY, rank, layout["ep"], recorder, source, recipe.name, metrics,
                          "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records), started)
    return records


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    with ENTRY.ending_cleanly():  # a rank that died: one line, not gloo's traceback
        generate(args)


if __name__ == "__main__":
    main()
