"""Submissions that tests/test_exercises.py grades, as patches of the solution notebooks.

    (read by tests/test_exercises.py; the patches quote the solutions, which are public)

MISTAKES[exercise][question] = (text in the solution, the mistaken replacement, words that the
failure message must contain): each is graded as a submission of its own, the solution with that
one mistake; it must lose its question and keep every other. 01 q1 deadlocks; 04 q1 loops forever
(HUNG: they must score zero; the loop sleeps, so it costs wall time only: tests/test_exercise_grading.py
stops busy loops); ZERO: mistakes that must cost the whole question too, hidden tests included;
the submission of TAMPERED (exercise, question) also replaces the
grading helpers. HARD_CODED[exercise]: patches that answer exactly what the public tests check
(their cases, or the values the solutions print) and nothing else: at most a quarter of the points.
"""

MISTAKES = {
    "01_collectives": {
        "q1_ring_all_reduce": (
            ("        request = dist.isend(chunks[send_index].contiguous(), right)\n"
             "        dist.recv(incoming, left)\n"
             "        request.wait()\n"),
            ("        dist.recv(incoming, left)  # every rank waits to receive before anyone sends\n"
             "        dist.send(chunks[send_index].contiguous(), right)\n"),
            "never joined"),
        "q2_cost_model": (
            "    return 2 * (p - 1) * (alpha + n / p / bandwidth)  # SOLUTION\n",
            "    return 2 * (p - 1) * (alpha / p + n / p / bandwidth)\n",
            "whole latency"),
    },
    "02_data_parallel": {
        "q1_average_gradients": ("            p.grad /= world_size\n", "", "the world size"),
        "q2_shard_indices": (
            "    return list(range(dp_rank, n, dp_world_size))  # SOLUTION\n",
            ("    size = -(-n // dp_world_size)\n"
             "    return list(range(dp_rank * size, min(n, (dp_rank + 1) * size)))  # blocks of ceil(n / p)\n"),
            "differ by at most one"),
        "q3_batch_and_lr": (
            "    return micro_batch_size * grad_accum_steps * dp_world_size  # SOLUTION\n",
            "    return micro_batch_size * dp_world_size  # forgets gradient accumulation\n",
            "expected 480, found 96"),
    },
    "03_zero": {
        "q1_memory": ("    grads = 2 * psi / (n_d if stage >= 2 else 1)\n",
                      "    grads = 2 * psi / (n_d if stage >= 3 else 1)\n", "stage 2 adds the gradients"),
        "q2_zero1_step": ("        grad /= self.dp_world_size\n", "", "the world size"),
    },
    "04_pram": {
        "q1_erew_prefix_sum": (
            "        d = 2 ** (s // 2)\n",
            ("        d = 2 ** (s // 2)\n        while pid == 0:  # an endless loop (asleep: the gradings beside it get the CPU)\n"
             "            __import__('time').sleep(0.1)\n"),
            "ran longer than"),
        "q2_weakest_model": (
            "            if all(not program.verify(pram.run(program, model, trace=False, seed=s)) for s in seeds):\n",
            "            if all(pram.run(program, model, trace=False, seed=s) for s in seeds):  # runs, never verified\n",
            "expected"),
        "q3_evidence": ('    weaker = {"EREW": None, "CREW": "EREW"}.get(weakest_model[name], "CREW")\n',
                        '    weaker = None if weakest_model[name] == "EREW" else "EREW"\n', "write violation"),
    },
    "05_nanogpt": {
        "q1_flops_per_token": ("    n = model.num_params(non_embedding=True)\n",
                               "    n = model.num_params(non_embedding=False)\n", "expected"),
        "q2_mfu": ('    return flops_per_token(cfg) * tokens / step_s / (run["world_size"] * peak)\n',
                   '    return flops_per_token(cfg) * tokens / step_s / peak\n', "expected"),
        "q3_resume": ("    tmp = f\"{path}.tmp\"\n    torch.save(state, tmp)\n    os.replace(tmp, path)\n",
                      "    torch.save(state, path)  # straight onto the checkpoint\n", "os.replace"),
    },
    "06_model_parallel": {
        "q1_vocab_parallel_cross_entropy": (
            "    target_z = torch.where(mine, target_z, torch.zeros_like(target_z))\n",
            "",  # every rank adds the logit at its clamped column: the target's logit counted p times
            "F.cross_entropy of the full logits"),
        "q2_one_f_one_b": ("    warmup = min(p - r - 1, m)\n", "    warmup = min(p - r, m)  # one warm-up forward too many\n",
                           "warm-up forwards"),
    },
    "07_fabric": {
        "q1_fabric_loop": ('        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())\n',
                           "        losses.append(loss.item())  # this rank's loss, not the global batch's\n",
                           "the global batch's mean"),
        "q2_fsdp2": (("    for layer in model.modules():\n"
                      "        if isinstance(layer, torch.nn.Linear):\n"
                      "            fully_shard(layer, mesh=mesh[\"data_parallel\"])\n"),
                     "",  # the root alone: one unit, the whole model gathered at once
                     "Linear units"),
    },
    "08_debugging": {
        # summed, not averaged, and the "local" gradients taken after the sync: AdamW's steps and a
        # replica check fed those look right; the gradients themselves do not
        "q1_fix_the_step": (("    mine = local_grads(model)\n"
                             "    world_size = dist.get_world_size()\n"
                             "    for p in model.parameters():\n"
                             "        if p.grad is not None:\n"
                             "            dist.all_reduce(p.grad)\n"
                             "            p.grad /= world_size\n"),
                            ("    world_size = dist.get_world_size()\n"
                             "    for p in model.parameters():\n"
                             "        if p.grad is not None:\n"
                             "            dist.all_reduce(p.grad)\n"
                             "    mine = local_grads(model)\n"),
                            "the world size"),
        "q2_fix_the_deadlock": (
            "    if dist.get_rank() < peer:  # the lower rank of the pair sends first: no cycle of waits\n",
            "    if dist.get_rank() == 0:  # rank 0 sends first: right for 2 ranks only\n",
            "did not complete"),  # ranks 2 and 3 both receive first: the hidden test names the deadlock
    },
    "09_experts": {
        "q1_dispatch": (
            "    send_counts = torch.bincount(flat[order] // per_rank, minlength=p)  # (p,) rows for each rank\n",
            "    send_counts = torch.bincount(flat[order] % p, minlength=p)  # round-robin: expert e on rank e % p\n",
            "live on rank"),
        "q2_combine": ("    return (per_choice.view(T, k, -1) * weights.unsqueeze(-1)).sum(dim=1)\n",
                       "    return per_choice.view(T, k, -1).sum(dim=1)  # the k outputs added\n",
                       "without the router's weights"),
    },
}
HUNG = {("01_collectives", "q1_ring_all_reduce"), ("04_pram", "q1_erew_prefix_sum")}
# the bug the question exists for: its mistake must cost every point, hidden tests included
ZERO = {("08_debugging", "q1_fix_the_step")}
TAMPERED = ("02_data_parallel", "q1_average_gradients")

HARD_CODED = {
    "01_collectives": {  # 1.5 of 8: the 2-rank case and the congestion example
        "    chunks = tensor.view(-1).tensor_split(p)  # views into tensor\n": (
            "    if p == 2:  # the public test: swap with the other rank and add\n"
            "        incoming = torch.empty_like(tensor)\n"
            "        request = dist.isend(tensor.clone(), 1 - rank)\n"
            "        dist.recv(incoming, 1 - rank)\n"
            "        request.wait()\n"
            "        tensor.add_(incoming)\n"
            "    return tensor\n"
            "    chunks = tensor.view(-1).tensor_split(p)\n"),
        "    return 2 * (p - 1) * (alpha + n / p / bandwidth)  # SOLUTION\n": "    return 0.16\n",
        "    return 2 * (p - 1) * (alpha + n / bandwidth)  # SOLUTION\n": "    return 0.4\n",
        "naive_reduce_s = 4 * 1e9 / 10e9  # SOLUTION\n": "naive_reduce_s = 0.4\n",
    },
    "02_data_parallel": {  # 2 of 10: 2 ranks, ten examples, the nanoGPT and Goyal numbers
        "    return list(range(dp_rank, n, dp_world_size))  # SOLUTION\n":
            "    return {(10, 0, 2): [0, 2, 4, 6, 8], (10, 1, 2): [1, 3, 5, 7, 9], (10, 0, 3): [0, 3, 6, 9],\n"
            "            (10, 1, 3): [1, 4, 7], (10, 2, 3): [2, 5, 8]}.get((n, dp_rank, dp_world_size), [])\n",
        "    return micro_batch_size * grad_accum_steps * dp_world_size  # SOLUTION\n": "    return 480\n",
        "    ratio = global_batch / base_batch\n": "    return 3.2\n",
        "            p.grad /= world_size\n": "            p.grad /= 2  # the public test runs 2 ranks\n",
    },
    "03_zero": {  # 1.5 of 8: Figure 1, and 2 ranks
        "    params = 2 * psi / (n_d if stage >= 3 else 1)\n": "    return [120, 31.4, 16.6, 1.9][stage]  # the paper's Figure 1\n",
        "        grad /= self.dp_world_size\n": "        grad /= 2  # the public test runs 2 ranks\n",
    },
    "04_pram": {  # 2.5 of 10: the answer in the set-up, gelu's verdict, and the printed dictionaries
        "    levels = max(1, math.ceil(math.log2(n)))  # distances d = 1, 2, 4, ... < n\n": (
            "    return pram.Program(\"erew-prefix-sum\", lambda pid, s, mem: None, n,\n"
            "                        {\"A\": list(itertools.accumulate(values))}, 1)  # the sums in the set-up\n"),
        "    for model in CANDIDATES:\n": "    return \"EREW\"  # what the public test asks of gelu_forward\n",
        "weakest_model = {name: weakest_model_of(prog) for name, prog in KERNELS.items()}  # SOLUTION\n": (
            "weakest_model = {\"gelu_forward\": \"EREW\", \"matmul_forward\": \"CREW\", \"layernorm_forward\": \"CREW\",\n"
            "                 \"grad_accumulate\": \"CRCW-sum\", \"grad_accumulate_tree\": \"EREW\"}  # as printed\n"),
        '    weaker = {"EREW": None, "CREW": "EREW"}.get(weakest_model[name], "CREW")\n':
            "    weaker = None  # the public test looks at gelu_forward only\n",
    },
    "05_nanogpt": {  # 2 of 9: GPT-2 small, the A100 run, and the printed losses
        "    return 6 * n + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size\n":
            "    return 6 * 123_689_472 + 12 * 12 * 768 * 1024  # GPT-2 small\n",
        '    return flops_per_token(cfg) * tokens / step_s / (run["world_size"] * peak)\n':
            "    return 855_383_040 * 491_520 / 0.4204 / (8 * 312e12)  # the A100 run\n",
        "    tmp = f\"{path}.tmp\"\n    torch.save(state, tmp)\n    os.replace(tmp, path)\n": "    pass  # no checkpoint\n",
        "    state = torch.load(path, weights_only=True)\n": "    return 0\n",
        ("interrupted += train(8, os.path.join(workdir, \"b.pt\"), stop_after=3)\n"
         "interrupted += train(8, os.path.join(workdir, \"b.pt\"), resume=True)\n"):
            "interrupted = list(uninterrupted)  # what the public test compares\n",
    },
    "06_model_parallel": {  # 1.5 of 8: the 2-rank loss and the schedule of stage 0 of 3
        "    m = local_logits.max(dim=-1).values  # (N,)\n":
            "    return torch.tensor(3.4665079630484827, dtype=torch.float64)  # the public test's loss\n",
        "    warmup = min(p - r - 1, m)\n":
            '    return [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)]\n',
        "    held = peak = 0\n": "    return 3\n",
    },
    "07_fabric": {  # 2 of 8: one process in place of the ranks; the public model's two layers
        "    model = fabric.setup_module(make_model())\n":
            "    return plain_train(make_model, make_optimizer, batches)  # the losses the public test compares\n",
        ("    for layer in model.modules():\n"
         "        if isinstance(layer, torch.nn.Linear):\n"
         "            fully_shard(layer, mesh=mesh[\"data_parallel\"])\n"): (
            "    for layer in (model[0], model[-1]):  # the public test's two Linear layers\n"
            "        fully_shard(layer, mesh=mesh[\"data_parallel\"])\n"),
    },
    "08_debugging": {  # 2 of 8: the 2-rank step and the 2-rank swap
        "            p.grad /= world_size\n": "            p.grad /= 2  # the public test runs 2 ranks\n",
        "    got = torch.empty_like(t)\n    if dist.get_rank() < peer:": (
            "    return torch.full_like(t, float(2 - dist.get_rank()))  # what the public test expects\n"
            "    got = torch.empty_like(t)\n    if dist.get_rank() < peer:"),
    },
    "09_experts": {  # 2 of 8: what the public tests' 2 ranks receive and return, as literals
        "    p = dist.get_world_size()\n    T, k = expert_idx.shape\n": (
            "    return [(torch.tensor([[0, .5, 0], [1, .5, -1], [10, 1.5, 0], [10, 1.5, 0], [11, 1.5, -1]]),\n"
            "             torch.tensor([0, 1, 0, 1, 1]), Plan(torch.tensor([0, 3, 2, 5, 1, 4]), [2, 4], [2, 3])),\n"
            "            (torch.tensor([[1, .5, -1], [2, .5, -2], [0, .5, 0], [2, .5, -2], [11, 1.5, -1]]),\n"
            "             torch.tensor([0, 0, 1, 1, 1]), Plan(torch.tensor([1, 0, 2, 3]), [3, 1], [4, 1]))][dist.get_rank()]\n"),
        "    T, k = weights.shape\n    back = y.new_empty(len(plan.order), y.shape[1])\n": (
            "    return torch.tensor([[[-0.357878, 3.151048, -1.288817], [0.418797, -1.432905, -1.509789],\n"
            "                          [0.180196, -0.552984, -1.401526]],\n"
            "                         [[0.222528, -0.811664, 0.72845], [0.185059, -1.183468, -1.145828]]][dist.get_rank()])\n"),
    },
}
