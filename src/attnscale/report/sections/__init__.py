"""Report sections: one module per experiment, each exposing ``report_section(fig_dir, *, seed)``."""
