"""Independent checks of what recipes/generate.py and recipes/evaluate.py wrote, under torchrun (2 gloo
ranks, EP = 2), run by tests/entry_points/test_inference.py.

The model is rebuilt from the same flags (``--load`` of the same fine-tuning checkpoint) but with plain
EP, and:

* generation oracle: for every prompt, greedy decoding by recomputing the whole growing sequence
  without a KV cache (argmax of ``GPTModel``'s last logits over the tokenizer's ids, one prompt at a
  time, no Megatron inference code), routed by the same per-(prompt, position) forced routing; its
  tokens must equal generate.py's and its log-probs match within 1e-5;
* evaluation: evaluate.py's loss at plain EP, in-process (the test compares it with the LLEP run's), and
  an indexed dataset written with recipes/make_indexed_dataset.py evaluated the same way;
* the fine-tuning run's validation windows evaluated with the experts in the checkpoint's CAP placement,
  and after moving them to another ``--llep-placement`` (its loss is the run's; the test compares);
* negative control: one expert weight perturbed by 0.1 changes both the recomputed log-probs and
  the evaluation loss beyond those tolerances.

Prints one JSON line (rank 0) with the measured differences.

    python -m torch.distributed.run --nproc_per_node 2 tests/workers/inference_worker.py SPEC_JSON
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from recipes.runtime.cpu_warnings import quiet_known_cpu_warnings  # noqa: E402

quiet_known_cpu_warnings()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from recipes import evaluate, generate  # noqa: E402
from recipes.runtime import model_building, model_sources  # noqa: E402
from recipes.runtime.logits import lm_logits  # noqa: E402


def recompute_greedy(model, routing, prompts, max_new_tokens: int, eos: int, vocab: int) -> list[tuple[list, list]]:
    """Greedy decoding by full recomputation (no KV cache), one prompt at a time; every rank runs the
    same forwards (rank 0's choice is taken, as generate.py does)."""
    results = []
    for index, (_, ids) in enumerate(prompts):
        sequence, tokens, log_probs = list(ids), [], []
        for _ in range(max_new_tokens):
            tokens_in = torch.tensor([sequence])
            positions = torch.arange(len(sequence)).unsqueeze(0)
            routing.force([index], positions)
            with torch.no_grad():
                logits = lm_logits(model, tokens_in, positions)[0, -1].float()
            choice = logits[:vocab].argmax().reshape(1)
            dist.broadcast(choice, src=0)
            token = int(choice)
            if token == eos:
                break
            tokens.append(token)
            log_probs.append(float(torch.log_softmax(logits, dim=-1)[token]))
            sequence.append(token)
        results.append((tokens, log_probs))
    return results


def evaluation_loss(model, eval_args, world: int, recipe) -> float:
    """evaluate.py's loss for ``eval_args`` on this (already built) model, in-process."""
    from functools import partial

    from megatron.core.pipeline_parallel import get_forward_backward_func

    from recipes.runtime import dashboard, evaluation, finetuning, sft_data

    samples, _, _ = evaluation.read_data(eval_args, world)
    dataset = sft_data.PackedSFTDataset(samples, eval_args.seq_length, seed=finetuning.VALID_PACKING_SEED)
    layout = model_building.parallel_layout(eval_args, world, recipe.config.num_moe_experts)
    count = min(dataset.num_windows, evaluation.windows_wanted(eval_args, layout["global_batch"]) or dataset.num_windows)
    state = {"microbatch": 0}
    step = partial(finetuning.forward_step, torch.device("cpu"), model_building.moe_layers(model), eval_args,
                   recipe.config, state)
    loss, _, _ = finetuning.evaluate(model, get_forward_backward_func(), step, state,
                                   evaluation.EvaluatedWindows(dataset, count), -(-count // layout["global_batch"]),
                                   eval_args, layout, 0, dashboard.MoELoadMeter(model))
    model.eval()
    return loss


def main() -> None:
    spec = json.loads(sys.argv[1])
    args = generate.parse_args(spec["generate_args"] + ["--no-llep"])
    rank, world, device = generate.ENTRY.start(0)
    source = model_sources.open_source(args, generate.ENTRY, rank)
    tokenizer = model_sources.load_tokenizer(args, generate.ENTRY, rank)
    prompts = generate.read_prompts(args, tokenizer)
    args.seq_length = max(len(ids) for _, ids in prompts) + args.max_new_tokens
    recipe, model, _ = model_sources.build(args, source, generate.ENTRY, rank, world, device, tokenizer.vocab_size)
    routing = generate.PositionalRouting(model_building.moe_layers(model), args.seq_length, *args.force_routing,
                                         seed=args.seed)
    with open(spec["generations"]) as f:
        written = [json.loads(line) for line in f]
    oracle = recompute_greedy(model, routing, prompts, args.max_new_tokens, tokenizer.eos_id, tokenizer.vocab_size)
    report = {"prompts": len(prompts), "tokens_equal": [r["generated_token_ids"] == o[0] for r, o in zip(written, oracle)],
              "generated": [len(o[0]) for o in oracle],
              "max_log_prob_diff": max(abs(a - b) for r, o in zip(written, oracle)
                                       for a, b in zip(r["log_probs"], o[1]))}

    eval_args = evaluate.parse_args(spec["evaluate_args"] + ["--no-llep"])
    eval_args.tokenizer = args.tokenizer  # open_source() settled it
    report["eval_loss"] = evaluation_loss(model, eval_args, world, recipe)

    # an indexed dataset of the shipped data (byte tokenizer) through evaluate.py's reader
    prefix = os.path.join(spec["scratch"], "tiny")
    if rank == 0:
        from recipes.runtime.indexed_data import build_indexed_dataset

        build_indexed_dataset(eval_args.data, prefix)
    dist.barrier()
    indexed_args = evaluate.parse_args([*spec["evaluate_args"], "--no-llep", "--data", f"{prefix}_text_document"])
    indexed_args.tokenizer = args.tokenizer
    report["indexed_format"] = indexed_args.data_format
    report["indexed_loss"] = evaluation_loss(model, indexed_args, world, recipe)

    # the fine-tuning run's validation windows, natural routing, experts in the checkpoint's placement
    from megatron_llep.runtime.forced_routing import force_routing

    for layer in model_building.moe_layers(model):
        force_routing(layer.router, None)  # Megatron's router replay stays on until cleared
    valid_args = evaluate.parse_args(spec["valid_args"] + ["--no-llep"])
    valid_args.tokenizer = args.tokenizer
    report["kept_placement_valid_loss"] = evaluation_loss(model, valid_args, world, recipe)

    # negative control: one weight of the first expert of EP rank 0 (physical slot 0, hot under the forced
    # routing) moved by 0.1
    if rank == 0:
        with torch.no_grad():
            next(model_building.moe_layers(model)[0].experts.parameters()).view(-1)[0] += 0.1
    perturbed = recompute_greedy(model, routing, prompts[:1], args.max_new_tokens, tokenizer.eos_id, tokenizer.vocab_size)
    report["perturbed_max_log_prob_diff"] = max(abs(a - b) for a, b in zip(written[0]["log_probs"], perturbed[0][1]))
    report["perturbed_eval_loss"] = evaluation_loss(model, eval_args, world, recipe)

    # --load with another --llep-placement: the experts restored to their original order, then placed anew
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    moved_args = evaluate.parse_args(spec["valid_args"] + ["--llep-placement", spec["other_placement"]])
    moved_source = model_sources.open_source(moved_args, evaluate.ENTRY, rank)
    recipe, moved, _ = model_sources.build(moved_args, moved_source, evaluate.ENTRY, rank, world, device,
                                           tokenizer.vocab_size)
    report["other_placement_valid_loss"] = evaluation_loss(moved, moved_args, world, recipe)
    if rank == 0:
        print("REPORT " + json.dumps(report), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
