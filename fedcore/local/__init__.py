"""The one-machine process runtime: ``fedcore run`` starts each role as its own process
(``runner``), or many clients per process when there are many (``groups``), forked from a
warm template or exec'd (``launch``), on loopback ports that no
other process is handed (``ports``), each at a fixed torch and BLAS thread count
(``threads``). Nothing here imports the command line: the launcher is given the role's entry
point."""
