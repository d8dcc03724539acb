from fxmem.cli import main

raise SystemExit(main())
