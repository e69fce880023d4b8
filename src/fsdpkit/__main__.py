from fsdpkit.cli.main import main

raise SystemExit(main())
