from warmup_agent.cli import main

raise SystemExit(main())
