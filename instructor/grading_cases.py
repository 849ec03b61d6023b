"""Submissions that tests/test_exercises.py grades, as patches of the solution notebooks.

    (read by tests/test_exercises.py; private, like the sources: the patches quote solutions)

MISTAKES[exercise][question] = (text in the solution, the mistaken replacement, words that the
failure message must contain). 01 q1 deadlocks; 04 q1 loops forever (HUNG: they must score zero);
the mistaken notebook of TAMPERED also replaces the grading helpers. HARD_CODED: an exercise and
patches that hard-code what its public tests check.
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
            "        d = 2 ** (s // 2)\n        while pid == 0:  # an endless loop\n            pass\n",
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
}
HUNG = {("01_collectives", "q1_ring_all_reduce"), ("04_pram", "q1_erew_prefix_sum")}
TAMPERED = "02_data_parallel"

# Hard-coding the public answers of 02 (the numbers its public tests check).
HARD_CODED = ("02_data_parallel", {
    "    return list(range(dp_rank, n, dp_world_size))  # SOLUTION\n":
        "    return {(10, 0, 2): [0, 2, 4, 6, 8], (10, 1, 2): [1, 3, 5, 7, 9], (10, 0, 3): [0, 3, 6, 9],\n"
        "            (10, 1, 3): [1, 4, 7], (10, 2, 3): [2, 5, 8]}.get((n, dp_rank, dp_world_size), [])\n",
    "    return micro_batch_size * grad_accum_steps * dp_world_size  # SOLUTION\n": "    return 480\n",
    "    ratio = global_batch / base_batch\n": "    return 3.2\n",
    "            p.grad /= world_size\n": "            p.grad /= 2  # the public test runs 2 ranks\n",
})
