"""What the notebooks display: smoke mode, figures, widgets, the live loss plot, Mermaid diagrams.

    smoke           the smoke-mode switch (COURSE_SMOKE=1) and each notebook's Colab cell
    plots           matplotlib figures of the course's models and benchmarks
    precision_plots the mixed-precision lesson's figures (notebook 9)
    widgets         the memory calculator of notebook 4
    live_plot       a loss plot that redraws while the model trains
    diagrams        Mermaid diagrams in notebooks and ``course images``
    diagrams_build  rendering them with mermaid-cli, and the staleness check
"""
