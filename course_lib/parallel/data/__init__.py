"""Data parallelism: every rank a whole model, its own samples, gradients averaged (imports nothing).

    ddp        DataParallelNaive (one all-reduce per gradient) and DataParallelBucket (bucketed,
               overlapped with backward) side by side, one interface (nn.Module wrappers, like
               torch's DistributedDataParallel); strategies "ddp_naive", "ddp"
    buckets    the one bucket-closing rule (DDP's bucket_cap_mb), for DP and ZeRO
    ring       data parallelism's communication from scratch: the ring all-reduce from
               point-to-point messages, one step at a time
"""
