"""Context parallelism: every sequence split over the cp ranks (imports nothing).

    comms           one hop of the ring (send to the next rank, receive from the previous) as
                    an autograd function
    ring_attention  ring attention over cp ranks with zigzag chunks
"""
