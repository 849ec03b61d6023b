"""Pipeline parallelism: consecutive layers on consecutive ranks (imports nothing).

    comms      point-to-point messages between stages (activations, gradients, their clock
               ticks) and the tied weight's gradient exchange
    schedules  stages, micro-batches, AFAB (GPipe) and 1F1B side by side behind one Pipeline,
               the bubble measured
"""
