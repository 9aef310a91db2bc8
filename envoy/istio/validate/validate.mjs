// Checks every Istio and Gateway API object in the given multi-document
// YAML files against its CRD schema (@kubernetes-models, pinned in
// package.json); Kubernetes' own kinds are left to kubernetes-validate
// (make validate-istio runs both). Exits 1 naming each object that fails.
import { readFileSync } from "node:fs";
import { parseAllDocuments } from "yaml";
import { EnvoyFilter } from "@kubernetes-models/istio/networking.istio.io/v1alpha3/EnvoyFilter";
import { DestinationRule } from "@kubernetes-models/istio/networking.istio.io/v1/DestinationRule";
import { Gateway } from "@kubernetes-models/gateway-api/gateway.networking.k8s.io/v1/Gateway";
import { HTTPRoute } from "@kubernetes-models/gateway-api/gateway.networking.k8s.io/v1/HTTPRoute";

const models = {
  "networking.istio.io/v1alpha3 EnvoyFilter": EnvoyFilter,
  "networking.istio.io/v1 DestinationRule": DestinationRule,
  "gateway.networking.k8s.io/v1 Gateway": Gateway,
  "gateway.networking.k8s.io/v1 HTTPRoute": HTTPRoute,
};
const kubernetesKinds = new Set(["v1 ConfigMap", "v1 Service", "apps/v1 Deployment"]);

let failed = 0;
let checked = 0;
for (const file of process.argv.slice(2)) {
  for (const document of parseAllDocuments(readFileSync(file, "utf8"))) {
    if (document.errors.length > 0) {
      console.error(`${file}: YAML: ${document.errors.join("; ")}`);
      failed++;
      continue;
    }
    const object = document.toJS();
    if (object === null) continue;
    const type = `${object.apiVersion} ${object.kind}`;
    const name = `${file}: ${object.kind} ${object.metadata?.name}`;
    const Model = models[type];
    if (Model === undefined) {
      if (!kubernetesKinds.has(type)) {
        console.error(`${name}: no schema for ${type}`);
        failed++;
      }
      continue;
    }
    try {
      new Model(object).validate();
      checked++;
    } catch (error) {
      console.error(`${name}: ${error.message}`);
      failed++;
    }
  }
}
if (failed > 0) process.exit(1);
console.log(`${checked} Istio / Gateway API objects match their schemas`);
