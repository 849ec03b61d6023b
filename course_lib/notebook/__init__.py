"""What a person sees: smoke mode, figures, widgets, the live loss plot, Mermaid diagrams, the demo.

The top layer of course_lib: nothing else in the package imports it.

    smoke           the smoke-mode switch (COURSE_SMOKE=1) and each notebook's Colab cell
    plots           matplotlib figures of the course's models and benchmarks
    precision_plots the mixed-precision lesson's figures (notebook 9)
    layout_plots    runs under several dp x pp x cp x tp layouts side by side (notebook 10)
    frameworks_plots  the course's and Lightning Fabric's runs over one process, the labs' strategy table (notebook 11)
    moe_plots       the experts lesson: an all-to-all of a real routing, tokens per expert over training, ep against dp (notebook 13)
    widgets         the memory calculator of notebook 4
    live_plot       a loss plot that redraws while the model trains
    source          show_source: a course_lib function's code, highlighted, in a cell
    rank_tables     each rank's copy of a buffer as one table, step by step (with %%ranks)
    pram_slider     a slider over the steps of a traced PRAM run (notebook 6)
    static          a static copy of a widget's state in its output (for a reopened notebook or a website)
    book            the course website (``make book``): executed notebooks, cached, through Sphinx + MyST-NB
    diagrams        Mermaid diagrams in notebooks and ``course images``
    diagrams_build  rendering them with mermaid-cli, and the staleness check
    demo            ``make demo``: the instructor's end-to-end run, its sample and its loss plot
"""
