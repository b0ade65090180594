from thinwire.cli.main import main

raise SystemExit(main())
