// deploycheck renders what the deploy tests validate, with the same libraries the real tools use:
//
//	deploycheck kustomize DIR                      -> the rendered YAML stream (sigs.k8s.io/kustomize/api, as `kustomize build`)
//	deploycheck compose FILE ENVFILE [PROFILE...]  -> the loaded, schema-checked, interpolated project as JSON
//	                                                  (github.com/compose-spec/compose-go/v2, as `docker compose config`)
//
// It is built from the Go module proxy by the tests (tests/unit/test_deploy_*.py) and cached outside the repo.
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/compose-spec/compose-go/v2/cli"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
)

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "deploycheck: "+format+"\n", args...)
	os.Exit(1)
}

func main() {
	if len(os.Args) < 3 {
		fail("usage: deploycheck kustomize DIR | compose FILE ENVFILE [PROFILE...]")
	}
	switch os.Args[1] {
	case "kustomize":
		k := krusty.MakeKustomizer(krusty.MakeDefaultOptions())
		resources, err := k.Run(filesys.MakeFsOnDisk(), os.Args[2])
		if err != nil {
			fail("kustomize %s: %v", os.Args[2], err)
		}
		out, err := resources.AsYaml()
		if err != nil {
			fail("kustomize %s: %v", os.Args[2], err)
		}
		os.Stdout.Write(out)
	case "compose":
		if len(os.Args) < 4 {
			fail("usage: deploycheck compose FILE ENVFILE [PROFILE...]")
		}
		opts, err := cli.NewProjectOptions(
			[]string{os.Args[2]},
			cli.WithName("llmbatch"),
			cli.WithEnvFiles(os.Args[3]),
			cli.WithDotEnv,
			cli.WithProfiles(os.Args[4:]),
		)
		if err != nil {
			fail("compose options: %v", err)
		}
		project, err := opts.LoadProject(context.Background())
		if err != nil {
			fail("compose %s: %v", os.Args[2], err)
		}
		out, err := project.MarshalJSON()
		if err != nil {
			fail("compose %s: %v", os.Args[2], err)
		}
		os.Stdout.Write(out)
	default:
		fail("unknown command %q", os.Args[1])
	}
}
